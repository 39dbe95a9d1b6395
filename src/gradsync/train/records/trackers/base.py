"""What every tracker is given when it opens, and what it is sent for each step.

A tracker is opened on rank 0 once per attempt (a fresh start, a resume, a
restart) with a :class:`Start`, and holds ``through``: the last step it already
has. The fan-out sends it the checkpoint's steps it lacks (from ``metrics.jsonl``)
and then every new step after ``through``, so each tracker ends up with every
step of the run once, however many attempts it took:

* TensorBoard hides what an earlier attempt logged after the checkpoint
  (``purge_step``) and so holds the checkpoint's steps; CSV is rewritten from
  ``metrics.jsonl`` (already cut back to the checkpoint) on every open;
* W&B and MLflow histories cannot be cut back, so the resumed run (the same run
  id, kept in ``trackers.json``) holds what the earlier attempt logged, up to the
  last step ``metrics.jsonl`` held before it was cut back (``reached``); the steps
  between the checkpoint and ``reached`` are computed again and not sent twice.
  A run of the default even split is bit-reproducible, so those steps' values are
  the same; with ``--balance auto`` they agree to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SKIP_KEYS = ("step", "unix_time")  # the x axis and the wall clock, not metrics


@dataclass
class Start:
    """One attempt of a run, as a tracker sees it."""

    out: str  # the run directory
    step: int  # the checkpoint's step this attempt continues from (0: a fresh start)
    reached: int  # the last step an earlier attempt recorded (>= step; 0 when fresh)
    config: dict  # config.json's fields
    name: str  # the run's name: its directory's
    run_id: str  # gradsync's run id (checkpoint unit), a tag in W&B and MLflow
    saved: dict | None = None  # this tracker's entry of trackers.json (None: new to this run)
    history: list[dict] = field(default_factory=list)  # metrics.jsonl's steps <= step


class Tracker:
    """A tracker: ``log`` each step's scalars, ``close`` once (never raising on purpose)."""

    name = ""
    through = 0  # the last step this tracker already holds
    state: dict = {}  # what trackers.json keeps for the next attempt (a run id)

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        raise NotImplementedError

    def close(self, finished: bool) -> None:
        raise NotImplementedError


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers, by their metrics.jsonl names (a dict of numbers, such
    as ``eval_metrics``, as ``eval_metrics/NAME``). Lists (per-rank figures), flags and
    missing values stay in metrics.jsonl only; a NaN loss is recorded there as null."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIP_KEYS:
            continue
        items = value.items() if isinstance(value, dict) else ((None, value),)
        for sub, v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            out[key if sub is None else f"{key}/{sub}"] = v
    return out
