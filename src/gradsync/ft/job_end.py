"""When a job of replica groups is over, and what to do with the groups still running.

Shared by the two launchers that start groups themselves (``cli/train_groups.py``
on one machine, ``netlab/groups.py`` on emulated hosts). Once one group has
finished every step the job is done: a group still running that has not
committed the last step (it restarted too late to rejoin, and would wait out its
quorum timeout alone) is stopped after ``LAGGARD_GRACE_S``; one that has is
writing its summary and report, and gets ``FINISH_GRACE_S``.
"""

from __future__ import annotations

import os

from ..rundir import METRICS, read_metrics

FINISH_GRACE_S = 60.0  # a group that committed the last step: its summary and report
LAGGARD_GRACE_S = 5.0  # one that did not: it can no longer catch up


def group_dir(out: str, group: int) -> str:
    """Group ``group``'s own run directory under the job's ``--out``."""
    return os.path.join(out, f"group-{group}")


def last_committed(out: str, group: int) -> int:
    """The last step group ``group`` committed (0: none yet), from its ``metrics.jsonl``."""
    rows = read_metrics(os.path.join(group_dir(out, group), METRICS))[0]  # never raises
    return max((int(r["step"]) for r in rows if "loss" in r and "step" in r), default=0)


def grace_left(out: str, group: int, steps: int, since_finish_s: float) -> float:
    """Seconds group ``group`` may still run, ``since_finish_s`` after another group
    finished the job (<= 0: stop it)."""
    done = last_committed(out, group) >= steps
    return (FINISH_GRACE_S if done else LAGGARD_GRACE_S) - since_finish_s
