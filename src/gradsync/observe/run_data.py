"""Read a run directory as it is -- finished, cut off midway, or not a run at all.

A report is most needed when a run went wrong, so reading is forgiving: every
file is optional except the evidence that this *is* a run (config.json or
metrics.jsonl), a torn last line of metrics.jsonl (a crash mid-write) is
skipped, and whatever the run should have written but did not is listed in
``missing`` with what it costs the reader, so the page and the terminal can say
so instead of failing. What the run was not asked to write (a trace without
``--trace``, a drift result with ``--drift-every 0``, a bucket plan under ZeRO-3)
is not missing. File names and record fields: :mod:`gradsync.rundir`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import UsageError
from ..rundir import BASELINE, CONFIG, DRIFT, METRICS, PLAN, SUMMARY, TRACE, read_json
from ..rundir import read_metrics as _read_metrics


@dataclass
class RunData:
    path: str
    config: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    summary: dict | None = None
    trace: dict | None = None
    drift: dict | None = None
    plan: dict | None = None
    baseline: dict | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def world_size(self) -> int:
        return int(self.config.get("world_size") or (self.summary or {}).get("world_size") or 1)


_read_json = read_json


def _expected(run: RunData, name: str) -> bool:
    """Was the run asked to write ``name``? (Unknown settings: assume it was.)"""
    c = run.config
    if name == TRACE:
        return bool(c.get("trace", True) or c.get("trace_steps"))
    if name == DRIFT:
        every = c.get("drift_every", 1)
        if not every or c.get("strategy") == "zero3":
            return False
        last = run.metrics[-1].get("step", 0) if run.metrics else 0
        return last >= every or run.summary is not None
    if name == PLAN:
        return c.get("strategy") != "zero3"
    return True


def load_run(path: str) -> RunData:
    """Load what exists; raise UsageError if ``path`` is not a gradsync run directory."""
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory (expected a run directory written by "
                         "`gradsync train --out DIR`)")
    has_config = os.path.exists(os.path.join(path, CONFIG))
    has_metrics = os.path.exists(os.path.join(path, METRICS))
    if not (has_config or has_metrics):
        raise UsageError(f"{path} is not a gradsync run: it holds neither {CONFIG} nor {METRICS}")
    run = RunData(path)
    cfg = _read_json(os.path.join(path, CONFIG))
    if isinstance(cfg, dict):
        run.config = cfg
    else:
        run.missing.append(f"{CONFIG} ({'unreadable' if cfg is False else 'absent'}): "
                           "run settings unknown")
    run.metrics, bad = _read_metrics(os.path.join(path, METRICS))
    if bad == -1 or not run.metrics:
        run.missing.append(f"{METRICS}: no step finished, so no curves")
    elif bad:
        run.missing.append(f"{METRICS}: {bad} torn line(s) skipped (the run stopped mid-write)")
    for attr, name, cost in (
        ("summary", SUMMARY, "the run did not finish (cut off or failed); figures show the "
                             "steps that completed"),
        ("trace", TRACE, "no traced step (run with --trace): no measured timeline"),
        ("drift", DRIFT, "no drift check ran (--drift-every 0, or the run stopped first)"),
        ("plan", PLAN, "bucket plan unknown: no prediction to compare with"),
    ):
        value = _read_json(os.path.join(path, name))
        if isinstance(value, dict):
            setattr(run, attr, value)
        elif value is False or _expected(run, name):
            state = "unreadable" if value is False else "absent"
            run.missing.append(f"{name} ({state}): {cost}")
    base = _read_json(os.path.join(path, BASELINE, SUMMARY))
    run.baseline = base if isinstance(base, dict) else None
    steps = run.config.get("steps")
    if run.summary is None and steps and run.metrics:
        run.missing.insert(0, f"the run stopped after step {run.metrics[-1].get('step')} of "
                              f"{steps}")
    return run
