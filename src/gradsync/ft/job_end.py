"""When a job of replica groups is over, seen from the launchers that start groups themselves.

Shared by ``cli/train_groups.py`` (one machine) and ``netlab/groups.py`` (emulated
hosts). The groups agree on the end among themselves (``closing.py``): the ones
that finished the last step hold the final model until every group has it or is
gone, and a group that comes back after that stops on its own in one line. A
launcher only keeps a bound on it: once a group has exited 0, a group still running
that holds the final model (it committed the last step or healed into it) is
writing its summary and report, and gets ``FINISH_GRACE_S``; one that does not
gets ``LAGGARD_GRACE_S``, time to ask the lighthouse once and learn that the job
is over (``replica.QUORUM_TRY_S`` and the look at its status page), before it is
stopped.
"""

from __future__ import annotations

import os

from ..rundir import METRICS, read_metrics_file

FINISH_GRACE_S = 60.0  # a group that holds the final model: its summary and report
LAGGARD_GRACE_S = 30.0  # one that does not: time to learn the job is over and stop


def group_dir(out: str, group: int) -> str:
    """Group ``group``'s own run directory under the job's ``--out``."""
    return os.path.join(out, f"group-{group}")


def last_committed(out: str, group: int) -> int:
    """The last step group ``group`` holds (0: none yet), from its ``metrics.jsonl``: its
    last committed step, or the job's last step if it healed into it at the end."""
    m = read_metrics_file(os.path.join(group_dir(out, group), METRICS))  # never raises
    steps = [int(r["step"]) for r in m.records if "loss" in r and "step" in r]
    steps += [int(e["step"]) for e in m.events
              if e.get("event") == "end" and e.get("final") and isinstance(e.get("step"), int)]
    return max(steps, default=0)


def grace_left(out: str, group: int, steps: int, since_finish_s: float) -> float:
    """Seconds group ``group`` may still run, ``since_finish_s`` after another group
    finished the job (<= 0: stop it)."""
    done = last_committed(out, group) >= steps
    return (FINISH_GRACE_S if done else LAGGARD_GRACE_S) - since_finish_s
