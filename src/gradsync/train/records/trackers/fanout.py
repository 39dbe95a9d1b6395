"""Rank 0's record sink: ``metrics.jsonl`` first, then every ``--log`` tracker.

:class:`TrackedWriter` stands where the :class:`~gradsync.runfiles.MetricsWriter` stood
(``sess.writer``), so every record the run writes -- each step's loss, learning rate,
throughput, gradient norm, eval loss -- reaches the trackers with no second call
site, and closing the session (at the end, on a failure, on Ctrl-C) closes them.

A tracker is a convenience beside the run's own record: one that fails to open or
to write is reported once, in one line, and dropped; the training goes on (it has
to: rank 0 failing alone here would leave the other ranks waiting in a collective).
A missing package cannot get this far: ``--log`` is checked before workers start.
"""

from __future__ import annotations

import importlib
import os

from ....errors import StorageError
from ....rundir import METRICS, TRACKERS, read_json, read_metrics, write_json
from . import parse_log
from .base import Start, Tracker, scalars

MODULES = {"tensorboard": "tb", "csv": "csvfile", "wandb": "wandb_offline",
           "mlflow": "mlflow_local"}


class TrackedWriter:
    """``write(record)``: to metrics.jsonl, then to each tracker; ``close()``: all of them."""

    def __init__(self, writer, trackers: list[Tracker], say, last_step: int):
        self.writer, self.trackers, self.say = writer, list(trackers), say
        self.last_step, self.seen = last_step, 0

    def write(self, record) -> None:
        self.writer.write(record)
        rec = record.to_json() if hasattr(record, "to_json") else record
        step = rec.get("step")
        if "event" in rec or not isinstance(step, int):  # a restart note: metrics.jsonl's
            return
        self.seen = max(self.seen, step)
        values = scalars(rec)
        for t in list(self.trackers):
            if step > t.through:
                self._call(t, "write step", t.log, step, values, rec)

    def _call(self, t: Tracker, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker must not stop the run
            self.say(f"gradsync train: warning: --log {t.name}: could not {what} "
                     f"({type(e).__name__}: {e}); it is dropped, metrics.jsonl is complete")
            if t in self.trackers:
                self.trackers.remove(t)
                if what != "close":
                    self._call(t, "close", t.close, False)
            return False

    def close(self) -> None:
        finished = self.seen >= self.last_step
        for t in list(self.trackers):
            self._call(t, "close", t.close, finished)
        self.trackers = []
        self.writer.close()


def _open_one(name: str, start: Start) -> Tracker:
    module = importlib.import_module(f"{__package__}.{MODULES[name]}")
    return module.open_tracker(start)


def open_trackers(writer, cfg: dict, resumed: bool, step: int, reached: int | None,
                  run_id: str, say) -> TrackedWriter | object:
    """``writer`` wrapped with the trackers ``cfg["log"]`` names (``writer`` itself when none).

    ``resumed``: this attempt continues a checkpoint at ``step`` (False: a fresh start,
    whose trackers begin new runs); ``reached``: the last step metrics.jsonl held
    before it was cut back to ``step``. Call after metrics.jsonl was cut back.
    """
    names = parse_log(cfg.get("log", ""))
    if not names:
        return writer
    out = cfg["out"]
    path = os.path.join(out, TRACKERS)
    saved = read_json(path) if resumed else None
    saved = saved if isinstance(saved, dict) else {}
    history = read_metrics(os.path.join(out, METRICS))[0] if resumed else []
    history = [r for r in history if isinstance(r.get("step"), int) and r["step"] <= step]
    name = os.path.basename(os.path.abspath(out))
    opened: list[Tracker] = []
    for tracker in names:
        start = Start(out, step if resumed else 0, max(reached or 0, step) if resumed else 0,
                      cfg, name, run_id, saved.get(tracker), history)
        try:
            opened.append(_open_one(tracker, start))
        except Exception as e:  # noqa: BLE001 - see the module docstring
            say(f"gradsync train: warning: --log {tracker}: could not open it "
                f"({type(e).__name__}: {e}); training goes on without it")
    fan = TrackedWriter(writer, opened, say, int(cfg.get("steps") or 0))
    for t in list(fan.trackers):  # the checkpoint's steps a tracker new to this run lacks
        for rec in history:
            if rec["step"] > t.through and not fan._call(t, "write the earlier steps", t.log,
                                                         rec["step"], scalars(rec), rec):
                break
        t.through = max(t.through, step if resumed else 0)
    try:
        write_json(path, {**saved, **{t.name: t.state for t in fan.trackers}})
    except StorageError as e:  # a resume then starts new W&B/MLflow runs; nothing worse
        say(f"gradsync train: warning: --log: {e}")
    return fan
