"""The stretches of a run between resumes, each with its worker count.

A run stopped and continued -- by hand, by an elastic restart, on another number
of workers -- is one run in metrics.jsonl, but a reader of its curves must see
where it resumed (a jump in step time, a changed throughput) and on how many
workers each stretch ran. The files do not mark a resume explicitly, so it is
recognised from what every step record holds: ``time_s`` (seconds since this
session's loop started) falls back when a new session begins, and
``world_size`` changes when the worker count does. Restart events (written by
elastic restarts) mark the same points and are honoured too.

A fault-tolerant run's ``world_size`` counts the ranks of every group in the
step's quorum (``quorum``), so it changes whenever a group dies or comes back,
with no resume in this group; there a stretch's worker count is the group's own,
``world_size`` over the quorum's size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    first: int  # first step of the stretch
    last: int
    world_size: int

    @property
    def workers(self) -> str:
        return "1 worker" if self.world_size == 1 else f"{self.world_size} workers"


def segments(records: list[dict], events: list[dict] = ()) -> list[Segment]:
    """Consecutive stretches of ``records`` (step order) run by one session."""
    restarted = {e.get("step") for e in events if e.get("event") == "restart"}
    rows = [r for r in records if isinstance(r.get("step"), int)]
    out: list[Segment] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and not _new_session(rows[i - 1], rows[i], restarted):
            continue
        seg = rows[start:i]
        out.append(Segment(seg[0]["step"], seg[-1]["step"], _workers(seg[0])))
        start = i
    return out


def _workers(rec: dict) -> int:
    """This session's workers: a fault-tolerant step's ranks over its quorum's groups."""
    world, quorum = int(rec.get("world_size") or 1), rec.get("quorum")
    return max(1, world // len(quorum)) if isinstance(quorum, list) and quorum else world


def _new_session(prev: dict, rec: dict, restarted: set) -> bool:
    if _workers(rec) != _workers(prev) or rec["step"] - 1 in restarted:
        return True
    t0, t1 = prev.get("time_s"), rec.get("time_s")
    return isinstance(t0, (int, float)) and isinstance(t1, (int, float)) and t1 < t0


def resume_steps(segs: list[Segment]) -> list[int]:
    """The step each later stretch resumed from (its first step minus one)."""
    return [s.first - 1 for s in segs[1:]]


def segments_text(segs: list[Segment]) -> str:
    """``steps 1-3: 2 workers; resumed from step 3: steps 4-6: 3 workers``."""
    parts = []
    for i, s in enumerate(segs):
        span = f"step {s.first}" if s.first == s.last else f"steps {s.first}-{s.last}"
        parts.append(("" if i == 0 else f"resumed from step {s.first - 1}: ")
                     + f"{span}: {s.workers}")
    return "; ".join(parts)
