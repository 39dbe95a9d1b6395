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

A group's rows after its checkpoint are cut when it resumes (its launcher keeps
the run's metrics consistent with the checkpoint it continues from), so each step
is read from every group that recorded it, and a long run with many restarts is
read while it runs by a :class:`Watcher`, which keeps every row it ever saw.
Steps whose members' rows disagree (which a split brain would cause) are reported
as such (``disagree``).
"""

from __future__ import annotations

import os
import threading
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


class Watcher:
    """Reads the groups' metrics every ``every_s`` seconds in a thread and keeps every row
    and end event it saw, including those a resuming group later cuts."""

    def __init__(self, out: str, groups: int, every_s: float = 1.0):
        self.out, self.groups, self.every_s = out, groups, every_s
        self._seen: list[dict[tuple, dict]] = [{} for _ in range(groups)]
        self._ends: list[dict[tuple, dict]] = [{} for _ in range(groups)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def poll(self) -> None:
        for g, gr in enumerate(read_groups(self.out, self.groups)):
            for r in gr.rows:
                self._seen[g].setdefault((r["step"], r["unix_time"]), r)
            for e in gr.ends:
                self._ends[g].setdefault((e.get("step"), e.get("rounds")), e)

    def stop(self) -> list[GroupRows]:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()
        return self.rows()

    def rows(self) -> list[GroupRows]:
        return [GroupRows(sorted(self._seen[g].values(), key=lambda r: r["unix_time"]),
                          list(self._ends[g].values())) for g in range(self.groups)]


def _began(r: dict) -> float:
    """When the group's ``begin`` for this row's step started (it asked for the quorum)."""
    return r["unix_time"] - (r.get("step_time_s") or 0.0) - (r.get("quorum_s") or 0.0)


def _rows(source, groups: int) -> list[GroupRows]:
    """``source``: a job's ``--out`` (read now), or rows a :class:`Watcher` kept."""
    if isinstance(source, (str, os.PathLike)):
        return read_groups(os.fspath(source), groups)
    return source


def job_steps(source, groups: int) -> list[StepMembers]:
    """Every step some group committed, in order, with its quorum and heals."""
    by_step: dict[int, StepMembers] = {}
    for g, gr in enumerate(_rows(source, groups)):
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


def end_heals(source, groups: int) -> list[int]:
    """Groups that healed into the job's end (``closing.py``)."""
    return [g for g, gr in enumerate(_rows(source, groups))
            if any(e.get("healed") for e in gr.ends)]


def down_windows(source, groups: int, faults: list[tuple[int, float, float]]) -> list[Window]:
    """``faults``: (group, unix time it fired, seconds its link stays down or 0). Each
    fault's window ends when its group next asked for a quorum (its first committed row
    after the fault), not before the link was back; open if it never did."""
    rows = _rows(source, groups)
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
