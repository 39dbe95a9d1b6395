"""Who was in each step of a job of replica groups, and who should have been: from the run files.

The promise of the quorum (``lighthouse.py``, ``docs/fault_tolerance.md``): a group
that is alive and heartbeating is in every step's quorum; a group that failed is out
only for the steps it is down, and comes back by healing. This module checks it
after the fact, from each group's ``metrics.jsonl`` (``OUT/group-i``), for the
tests, the soak and ``benchmarks/fault_tolerance.py``:

* :func:`job_steps`: per committed step, the quorum that committed it, the groups
  that healed at it, and when it started (the earliest of its members);
* :func:`down_windows`: per fault, from when it fired until its group asked for a
  quorum again (a restarted group's first committed row says when its ``begin``
  started: its end minus the step's time minus the quorum wait), or until a
  partitioned link was back;
* :func:`left_out`: the groups missing from a step although no fault of theirs
  covers the step's start: a live group left out, which the quorum must never do.

A group's rows after its checkpoint are cut when it resumes, so each step is read
from every group that recorded it. Steps whose members' rows disagree (which a
split brain would cause) are reported as such (``disagree``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..rundir import METRICS, read_metrics_file


@dataclass
class StepMembers:
    """One committed step of the job."""

    step: int
    members: tuple[int, ...]
    healed: tuple[int, ...] = ()
    started: float = 0.0  # unix time its first member began training it
    committed: float = 0.0  # unix time its first member recorded it
    disagree: bool = False  # members' rows name different quorums


@dataclass
class Window:
    """Group ``group`` down (or cut off) from ``start`` to ``end`` (unix times)."""

    group: int
    start: float
    end: float = float("inf")


@dataclass
class GroupRows:
    """One group's committed rows and its end event."""

    rows: list[dict] = field(default_factory=list)
    ends: list[dict] = field(default_factory=list)


def read_groups(out: str, groups: int) -> list[GroupRows]:
    got = []
    for g in range(groups):
        m = read_metrics_file(os.path.join(out, f"group-{g}", METRICS))
        rows = [r for r in m.records if "loss" in r and isinstance(r.get("quorum"), list)
                and "unix_time" in r]
        got.append(GroupRows(rows, [e for e in m.events if e.get("event") == "end"]))
    return got


def _began(r: dict) -> float:
    """When the group's ``begin`` for this row's step started (it asked for the quorum)."""
    return r["unix_time"] - (r.get("step_time_s") or 0.0) - (r.get("quorum_s") or 0.0)


def job_steps(out: str, groups: int) -> list[StepMembers]:
    """Every step some group committed, in order, with its quorum and heals."""
    by_step: dict[int, StepMembers] = {}
    for g, gr in enumerate(read_groups(out, groups)):
        for r in gr.rows:
            s = by_step.get(r["step"])
            start = r["unix_time"] - (r.get("step_time_s") or 0.0)
            if s is None:
                s = by_step[r["step"]] = StepMembers(r["step"], tuple(r["quorum"]),
                                                      started=start, committed=r["unix_time"])
            elif tuple(r["quorum"]) != s.members:
                s.disagree = True
            s.started, s.committed = min(s.started, start), min(s.committed, r["unix_time"])
            if r.get("healed"):
                s.healed = tuple(sorted({*s.healed, g}))
    return [by_step[k] for k in sorted(by_step)]


def end_heals(out: str, groups: int) -> list[int]:
    """Groups that healed into the job's end (``closing.py``)."""
    return [g for g, gr in enumerate(read_groups(out, groups))
            if any(e.get("healed") for e in gr.ends)]


def down_windows(out: str, groups: int, faults: list[tuple[int, float, float]]) -> list[Window]:
    """``faults``: (group, unix time it fired, seconds its link stays down or 0). Each
    fault's window ends when its group next asked for a quorum (its first committed row
    after the fault), not before the link was back; open if it never did."""
    rows = read_groups(out, groups)
    out_w = []
    for g, fired, link_down_s in faults:
        after = [_began(r) for r in rows[g].rows if _began(r) > fired]
        back = min(after, default=float("inf"))
        heal_ends = [e for e in rows[g].ends if e.get("healed")]
        if not after and heal_ends:  # healed straight into the end: back at the end
            back = float("inf")
        out_w.append(Window(g, fired, max(back, fired + link_down_s)))
    return out_w


def left_out(steps: list[StepMembers], groups: int,
             windows: list[Window]) -> list[tuple[int, int]]:
    """(step, group) for every group missing from a step while no window of its covers
    the step's start: a live group left out."""
    bad = []
    for s in steps:
        for g in range(groups):
            if g in s.members:
                continue
            if not any(w.group == g and w.start <= s.started < w.end for w in windows):
                bad.append((s.step, g))
    return bad


def summary(steps: list[StepMembers], groups: int, windows: list[Window]) -> dict:
    """The counts a test or the benchmark's table reads."""
    missing = sum(groups - len(s.members) for s in steps)
    live = left_out(steps, groups, windows)
    return {"steps": len(steps), "full_steps": sum(len(s.members) == groups for s in steps),
            "heals": sum(len(s.healed) for s in steps), "missing": missing,
            "left_out_live": len(live), "left_out_live_at": live[:20],
            "disagree": [s.step for s in steps if s.disagree]}
