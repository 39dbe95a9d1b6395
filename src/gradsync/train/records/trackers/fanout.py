"""Rank 0's record sink: ``metrics.jsonl`` first, then every ``--log`` tracker, off the step.

:class:`TrackedWriter` stands where the :class:`~gradsync.runfiles.MetricsWriter` stood
(``sess.writer``), so every record the run writes -- each step's loss, learning rate,
throughput, gradient norm, eval loss -- reaches the trackers with no second call
site, and closing the session (at the end, on a failure, on Ctrl-C or SIGTERM) closes
them, each marked finished, killed or failed (``base.Outcome``).

The trackers live on a thread of their own. Opening them is most of their cost:
importing wandb, mlflow and tensorboard and starting W&B's service took seconds on
rank 0 before its first step, while every other rank waited for it in the step's
first collective (issue 37). Here the training starts at once: ``write`` appends to
metrics.jsonl (the run's record, on the training thread as before) and queues the
record; the thread opens the trackers, reads back what each holds, sends it the
checkpoint's steps it lacks, then the queued ones, and ends with their close. A
step's own cost on the training thread is a queue put.

A tracker is a convenience beside the run's own record: one that fails to open or
to write is reported once, in one line, and dropped; the training goes on (it has
to: rank 0 failing alone here would leave the other ranks waiting in a collective).
A missing package cannot get this far: ``--log`` is checked before workers start.
"""

from __future__ import annotations

import importlib
import os
import queue
import threading
from collections.abc import Callable

from ....rundir import METRICS, TRACKERS, read_json, read_metrics, write_json
from . import parse_log
from .base import FINISHED, Outcome, Start, Tracker, scalars

MODULES = {"tensorboard": "tb", "csv": "csvfile", "wandb": "wandb_offline",
           "mlflow": "mlflow_local"}
STOP_WAIT_S = 20.0
"""How long a stopped attempt waits for its trackers to close: below the elastic agent's
30 s between its stop signal and SIGKILL, so the worker still exits on its own."""


class TrackedWriter:
    """``write(record)``: to metrics.jsonl, then queued for the trackers' thread;
    ``committed(step)``: a checkpoint holds the steps up to ``step``; ``close(outcome)``.

    ``openers``: (name, a function that opens that tracker), called on the thread in
    order; ``history``: the checkpoint's step records, sent to a tracker that lacks
    them; ``opened(tracker)``: called on the thread as each tracker has opened (it
    records the tracker's run ids in trackers.json); ``say``: one line to the user,
    always said from the caller's thread.
    """

    def __init__(self, writer, openers: list[tuple[str, Callable[[], Tracker]]], say,
                 history: list[dict] = (), opened: Callable[[Tracker], None] | None = None):
        self.writer, self.say = writer, say
        self._notes: list[str] = []  # said by the caller's thread (the display is not shared)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradsync-trackers",
                                        args=(openers, list(history), opened), daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the training thread
    def write(self, record) -> None:
        self.writer.write(record)
        self._say_notes()
        rec = record.to_json() if hasattr(record, "to_json") else record
        if "event" in rec or not isinstance(rec.get("step"), int):  # a restart note
            return
        self._queue.put(("step", rec))

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` is on disk: the trackers that cannot cut back get it."""
        self._queue.put(("commit", step))

    def close(self, outcome: Outcome | None = None) -> None:
        """Close every tracker with ``outcome`` (default: finished; waiting at most
        :data:`STOP_WAIT_S` when the attempt was stopped), then metrics.jsonl."""
        outcome = outcome or Outcome()
        if outcome.status != FINISHED:  # a finished run's trackers all open and get it all
            self._closing.set()
        self._queue.put(("close", outcome))
        self._thread.join(None if outcome.status == FINISHED else STOP_WAIT_S)
        if self._thread.is_alive():
            self._notes.append(f"gradsync train: warning: --log: the trackers did not close "
                               f"within {STOP_WAIT_S:.0f} s; what they hold is read back when "
                               "the run continues")
        self._say_notes()
        self.writer.close()

    def _say_notes(self) -> None:
        while self._notes:
            self.say(self._notes.pop(0))

    # ------------------------------------------------------------ the trackers' thread
    def _call(self, trackers: list[Tracker], t: Tracker, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker must not stop the run
            self._notes.append(f"gradsync train: warning: --log {t.name}: could not {what} "
                               f"({type(e).__name__}: {e}); it is dropped, metrics.jsonl is "
                               "complete")
            if t in trackers:
                trackers.remove(t)
                if what != "close":
                    self._call(trackers, t, "close", t.close, Outcome("failed"))
            return False

    def _send(self, trackers: list[Tracker], t: Tracker, rec: dict, what: str) -> bool:
        if rec["step"] <= t.through:
            return True
        if not self._call(trackers, t, what, t.log, rec["step"], scalars(rec), rec):
            return False
        t.through, t.sent = rec["step"], t.sent + 1
        return True

    def _run(self, openers, history: list[dict], opened) -> None:
        trackers: list[Tracker] = []
        for name, open_one in openers:
            if self._closing.is_set():  # stopped while opening: the rest is not begun (the
                # resume sends them the checkpoint's steps)
                break
            try:
                t = open_one()
            except Exception as e:  # noqa: BLE001 - see the module docstring
                self._notes.append(f"gradsync train: warning: --log {name}: could not open it "
                                   f"({type(e).__name__}: {e}); training goes on without it")
                continue
            trackers.append(t)
            for rec in history:  # the checkpoint's steps this tracker lacks
                if not self._send(trackers, t, rec, "write the earlier steps"):
                    break
            if opened is not None and t in trackers:
                try:
                    opened(t)
                except Exception as e:  # noqa: BLE001 - a resume then starts new runs
                    self._notes.append(f"gradsync train: warning: --log: {e}")
        pending: list[dict] = []  # steps the trackers that cannot cut back wait for
        while True:
            kind, arg = self._queue.get()
            if kind == "step":
                for t in [t for t in trackers if t.cuts_back]:
                    self._send(trackers, t, arg, "write step")
                if any(not t.cuts_back for t in trackers):
                    pending.append(arg)
            elif kind == "commit":
                for t in list(trackers):
                    self._call(trackers, t, "flush", t.commit, arg)
                self._flush(trackers, [r for r in pending if r["step"] <= arg])
                pending = [r for r in pending if r["step"] > arg]
            else:  # close: a finished run's last steps are final too
                if arg.status == FINISHED:
                    self._flush(trackers, pending)
                for t in list(trackers):
                    self._call(trackers, t, "close", t.close, arg)
                return

    def _flush(self, trackers: list[Tracker], records: list[dict]) -> None:
        for t in [t for t in trackers if not t.cuts_back]:
            for rec in records:
                if not self._send(trackers, t, rec, "write step"):
                    break


def _open_one(name: str, start: Start) -> Tracker:
    module = importlib.import_module(f"{__package__}.{MODULES[name]}")
    return module.open_tracker(start)


def open_trackers(writer, cfg: dict, resumed: bool, step: int, run_id: str,
                  say) -> TrackedWriter:
    """``writer`` wrapped with the trackers ``cfg["log"]`` names.

    ``resumed``: this attempt continues a checkpoint at ``step`` (False: a fresh start,
    whose trackers begin new runs and remove what earlier attempts without a checkpoint
    began). Call after metrics.jsonl was cut back. Returns at once: the trackers open on
    their own thread.
    """
    names = parse_log(cfg.get("log", ""))
    out = cfg["out"]
    path = os.path.join(out, TRACKERS)
    earlier = read_json(path)
    earlier = earlier if isinstance(earlier, dict) else {}
    history = read_metrics(os.path.join(out, METRICS))[0] if resumed else []
    history = [r for r in history if isinstance(r.get("step"), int) and r["step"] <= step]
    name = os.path.basename(os.path.abspath(out))
    kept = dict(earlier) if resumed else {}

    def opener(tracker: str):
        return lambda: _open_one(tracker, Start(out, step if resumed else 0, resumed, cfg, name,
                                                run_id, earlier.get(tracker), history))

    def opened(t: Tracker) -> None:  # each at once: a stop while the next opens keeps it
        kept[t.name] = t.state
        write_json(path, kept)  # a StorageError is said; a resume then starts new runs

    return TrackedWriter(writer, [(n, opener(n)) for n in names], say, history, opened)
