"""What every tracker is given when it opens, what it is sent, and how an attempt ends.

A tracker is opened on rank 0 once per attempt (a fresh start, a resume, a
restart) with a :class:`Start`. It then *reads back* what it holds of this run
(``through``: its last step), from its own files, rather than assuming it: an
earlier attempt may have been stopped before its writer flushed, or killed. The
fan-out sends it the checkpoint's steps it lacks (from ``metrics.jsonl``) and then
every new step after ``through``, so each tracker ends up with every step of the run
once, however many attempts it took.

Two kinds, by whether their history can be cut back (``cuts_back``):

* TensorBoard (``purge_step`` hides what an earlier attempt logged after the
  checkpoint) and CSV (rewritten from ``metrics.jsonl``, already cut back to the
  checkpoint) get each step as it is written;
* W&B and MLflow histories cannot be cut back, so they get a step only once a
  checkpoint holds it (or the run has finished): a step after the last checkpoint
  is computed again by the resume, and the tracker must not already hold the
  first computation of it (its loss would agree, its timings would not). Their
  dashboards are therefore up to ``--checkpoint-every`` steps behind.

Every attempt ends with :meth:`Tracker.close` and an :class:`Outcome`: finished,
killed (Ctrl-C, SIGTERM, a clean stop) or failed (a worker failure). An attempt
that began a new W&B or MLflow run and sent it no step removes that run: a Ctrl-C
during start-up must leave nothing for ``wandb sync`` to upload as an extra run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SKIP_KEYS = ("step", "unix_time")  # the x axis and the wall clock, not metrics
HELD_KEY = "items"
"""A number every step record has: each tracker writes it last of a step, so a step
whose ``items`` a tracker holds is whole there (what reading back looks for)."""

FINISHED, KILLED, FAILED = "finished", "killed", "failed"


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the trackers record it."""

    status: str = FINISHED  # finished | killed | failed
    signal: int | None = None  # killed: the signal that stopped it, if one did

    @property
    def exit_code(self) -> int:
        """A process's exit code for it: 0, 128 + the signal (130 for Ctrl-C), or 1."""
        if self.status == FINISHED:
            return 0
        return 128 + (self.signal or 2) if self.status == KILLED else 1


@dataclass
class Start:
    """One attempt of a run, as a tracker sees it."""

    out: str  # the run directory
    step: int  # the checkpoint's step this attempt continues from (0: a fresh start)
    resumed: bool  # False: a fresh start, whose trackers begin new runs
    config: dict  # config.json's fields
    name: str  # the run's name: its directory's
    run_id: str  # gradsync's run id (checkpoint unit), a tag in W&B and MLflow
    saved: dict | None = None  # this tracker's entry of trackers.json (None: none there)
    history: list[dict] = field(default_factory=list)  # metrics.jsonl's steps <= step


class Tracker:
    """A tracker: ``log`` each step's scalars, ``close`` once (never raising on purpose)."""

    name = ""
    cuts_back = True  # False: sent only steps a checkpoint holds (see the module doc)
    through = 0  # the last step this tracker holds (read back when it opened)
    sent = 0  # steps this attempt sent it
    state: dict = {}  # what trackers.json keeps for the next attempt (a run id)

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        raise NotImplementedError

    def commit(self, step: int) -> None:
        """A checkpoint now holds every step up to ``step`` (a writer may flush here)."""

    def close(self, outcome: Outcome) -> None:
        raise NotImplementedError


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers, by their metrics.jsonl names (a dict of numbers, such
    as ``eval_metrics``, as ``eval_metrics/NAME``), :data:`HELD_KEY` last. Lists
    (per-rank figures), flags and missing values stay in metrics.jsonl only; a NaN loss
    is recorded there as null."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIP_KEYS or key == HELD_KEY:
            continue
        items = value.items() if isinstance(value, dict) else ((None, value),)
        for sub, v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            out[key if sub is None else f"{key}/{sub}"] = v
    held = record.get(HELD_KEY)
    if isinstance(held, (int, float)) and not isinstance(held, bool) and math.isfinite(held):
        out[HELD_KEY] = held
    return out
