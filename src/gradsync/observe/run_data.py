"""Read a run directory as it is -- finished, cut off midway, or not a run at all.

A report is most needed when a run went wrong, so reading is forgiving: every
file is optional except the evidence that this *is* a run (config.json or
metrics.jsonl), a torn last line of metrics.jsonl (a crash mid-write) is
skipped, and whatever is absent is listed in ``missing`` with what it costs the
reader, so the page and the terminal can say so instead of failing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..errors import UsageError

CONFIG, METRICS, SUMMARY = "config.json", "metrics.jsonl", "summary.json"
TRACE, DRIFT, PLAN = "trace.json", "drift.json", "plan.json"


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


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return False  # present but unreadable


def _read_metrics(path: str) -> tuple[list[dict], int]:
    rows, bad = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    bad += 1
    except FileNotFoundError:
        return [], -1
    return rows, bad


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
        else:
            state = "unreadable" if value is False else "absent"
            run.missing.append(f"{name} ({state}): {cost}")
    base = _read_json(os.path.join(path, "baseline", SUMMARY))
    run.baseline = base if isinstance(base, dict) else None
    steps = run.config.get("steps")
    if run.summary is None and steps and run.metrics:
        run.missing.insert(0, f"the run stopped after step {run.metrics[-1].get('step')} of "
                              f"{steps}")
    return run
