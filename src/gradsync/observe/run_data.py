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
from ..rundir import (
    BASELINE,
    CONFIG,
    DRIFT,
    METRICS,
    PLAN,
    SUMMARY,
    TRACE,
    Summary,
    read_json,
    read_json_checked,
    read_metrics_file,
    write_json,
)
from .sync_mode import first_drift_check


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
    events: list[dict] = field(default_factory=list)  # restarts, from metrics.jsonl

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
    if name == DRIFT:  # where train/records/instrument.py checks: sync_mode.first_drift_check
        if not c.get("drift_every", 1) or c.get("strategy") == "zero3":
            return False
        first = first_drift_check(c)
        return run.summary is not None or (first is not None and _last_step(run) >= first)
    if name == PLAN:  # bucketed strategies only: zero3 reduces per unit, diloco has none
        return c.get("strategy") != "zero3" and c.get("sync", "exact") == "exact"
    return True


def _last_step(run: RunData) -> int:
    return run.metrics[-1].get("step", 0) if run.metrics else 0


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
    m = read_metrics_file(os.path.join(path, METRICS))
    run.metrics, run.events = m.records, m.events
    if not run.metrics:
        run.missing.append(f"{METRICS}: no step finished, so no curves")
    if m.dropped:
        run.missing.append(f"{METRICS}: {len(m.dropped)} damaged line(s) skipped "
                           f"({'; '.join(m.dropped[:3])})")
    _load_summary(run)
    for attr, name, cost in (
        ("trace", TRACE, "the run was traced, but trace.json was not written (the run "
                         "stopped before its trace window closed) or was removed: no "
                         "measured timeline"),
        ("drift", DRIFT, "the replica check's result is lost, though the run reached a "
                         "step where one was due"),
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
    if run.summary is None and steps and run.metrics and not _reached_end(run):
        run.missing.insert(0, f"the run stopped after step {run.metrics[-1].get('step')} of "
                              f"{steps}")
    return run


def _reached_end(run: RunData) -> bool:
    steps = run.config.get("steps")
    return bool(steps and run.metrics and run.metrics[-1].get("step") == steps)


def _load_summary(run: RunData) -> None:
    """summary.json, or -- when it is corrupt or lost and metrics.jsonl shows the last step
    done -- one rebuilt from metrics.jsonl and config.json, with a line saying so."""
    value, why = read_json_checked(os.path.join(run.path, SUMMARY))
    wrong = Summary.problem(value) if isinstance(value, dict) else None
    if isinstance(value, dict) and not wrong:
        run.summary = value
        return
    why = why or (f"corrupt ({wrong})" if wrong else
                  "absent" if value is None else "corrupt (not a JSON object)")
    steps, last = run.config.get("steps"), run.metrics[-1].get("step") if run.metrics else 0
    if _reached_end(run):
        run.summary = summary_from_metrics(run)
        run.missing.append(
            f"{SUMMARY} is {why}, but the run finished (metrics.jsonl reaches step {last} of "
            f"{steps}): this report rebuilt it from metrics.jsonl and config.json (the memory "
            "table and wall times it held are lost); `gradsync train` with the run's flags "
            "rewrites it")
    else:
        run.missing.append(f"{SUMMARY} ({why}): the run did not finish (cut off or failed); "
                           "figures show the steps that completed")


def summary_from_metrics(run: RunData) -> dict:
    """What summary.json said that metrics.jsonl and config.json still tell (``rebuilt``)."""
    c, m = run.config, run.metrics
    times = sorted(r["step_time_s"] for r in m[min(3, len(m) - 1):]
                   if isinstance(r.get("step_time_s"), (int, float)))
    median = times[len(times) // 2] if times else None
    evals = [r["eval_loss"] for r in m if r.get("eval_loss") is not None]
    drift = read_json(os.path.join(run.path, DRIFT))
    return {
        "model": c.get("model"), "data": c.get("data"), "strategy": c.get("strategy"),
        "precision": c.get("precision"), "optimizer": c.get("optimizer"),
        "seed": c.get("seed"), "steps": c.get("steps"), "world_size": c.get("world_size"),
        "accumulation": c.get("accumulation"), "global_batch": c.get("global_batch"),
        "micro_batch": c.get("micro_batch"), "final_loss": m[-1].get("loss"),
        "final_eval_loss": evals[-1] if evals else None,
        "resumed_from": max((e.get("step", 0) for e in run.events), default=0),
        "world_sizes": c.get("world_sizes"), "median_step_s": median,
        "samples_per_s": c["global_batch"] / median if median and c.get("global_batch") else None,
        "skipped_steps": [r["step"] for r in m if r.get("skipped") and not r.get("overflow")],
        "drift": drift if isinstance(drift, dict) else None,
        "rebuilt": f"from {METRICS} and {CONFIG}",
    }


def repair_summary(path: str) -> str | None:
    """A finished run's summary.json, rewritten from its metrics if it is corrupt or lost;
    returns a line saying so (None: nothing to repair)."""
    value, why = read_json_checked(os.path.join(path, SUMMARY))
    wrong = Summary.problem(value) if isinstance(value, dict) else None
    if (isinstance(value, dict) and not wrong) or not os.path.exists(os.path.join(path, METRICS)):
        return None
    why = why or (f"corrupt ({wrong})" if wrong else None)
    run = RunData(path, config=read_json(os.path.join(path, CONFIG)) or {})
    m = read_metrics_file(os.path.join(path, METRICS))
    run.metrics, run.events = m.records, m.events
    if not isinstance(run.config, dict) or not _reached_end(run):
        return None
    write_json(os.path.join(path, SUMMARY), summary_from_metrics(run))
    return (f"{SUMMARY} was {why or 'absent'}; rewrote it from {METRICS} and {CONFIG} "
            "(without the memory table and wall times)")
