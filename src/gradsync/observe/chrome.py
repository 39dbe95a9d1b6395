"""Chrome trace event JSON from the engine's spans: one file, one process per rank.

The format is the Trace Event Format that chrome://tracing and Perfetto open
(Horovod's timeline uses it too): complete events (``"ph": "X"``) with
microsecond ``ts``/``dur``, and metadata events naming each process ("rank r",
``pid = rank``) and thread (lane). Spans must nest within a lane, so compute
spans (step > forward/backward > sync wait, optimizer) share lane 0 while
collectives, which overlap each other and compute, are packed greedily onto
communication lanes 1, 2, ... so no two on one lane overlap.

Ranks' clocks are aligned through wall time: each rank records the offset from
its ``perf_counter`` to ``time.time()``, and the merged file starts at the
earliest span of any rank. On one machine that is exact; across machines it is
as good as their clock synchronisation.
"""

from __future__ import annotations

import json
import os

from ..engine.transport.tracing import Tracer
from ..rundir import TRACE, write_text

COMPUTE_TID = 0
TRACE_FILE = TRACE  # the run directory's name for it (gradsync.rundir)


def rank_payload(tracer: Tracer) -> dict:
    """What one rank sends to rank 0: picklable, compact."""
    return {
        "rank": tracer.rank,
        "wall_offset": tracer.wall_offset,
        "spans": [(s.name, s.cat, s.start, s.end, s.args) for s in tracer.spans],
    }


def _comm_lanes(spans: list[tuple]) -> list[int]:
    """Greedy interval packing: lane k (1-based) per span, no overlaps within a lane."""
    lanes_end: list[float] = []
    out = []
    for _, _, start, end, _ in spans:
        for k, last in enumerate(lanes_end):
            if last <= start:
                lanes_end[k] = end
                out.append(k + 1)
                break
        else:
            lanes_end.append(end)
            out.append(len(lanes_end))
    return out


def chrome_trace(payloads: list[dict]) -> dict:
    """Merge per-rank payloads into one Chrome trace object (sorted by rank)."""
    payloads = sorted(payloads, key=lambda p: p["rank"])
    starts = [p["wall_offset"] + s[2] for p in payloads for s in p["spans"]]
    origin = min(starts) if starts else 0.0
    events: list[dict] = []
    for p in payloads:
        rank, off = p["rank"], p["wall_offset"]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TID,
                       "args": {"name": "compute"}})
        spans = sorted(p["spans"], key=lambda s: (s[2], -s[3]))
        comm = [s for s in spans if s[1] == "comm"]
        lanes = _comm_lanes(comm)
        for lane in sorted(set(lanes)):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": lane,
                           "args": {"name": f"communication {lane}"}})
        lane_of = {id(s): lane for s, lane in zip(comm, lanes)}
        for s in spans:
            name, cat, start, end, args = s
            events.append({
                "name": name, "cat": cat, "ph": "X", "pid": rank,
                "tid": lane_of.get(id(s), COMPUTE_TID),
                "ts": round((off + start - origin) * 1e6, 3),
                "dur": round(max(0.0, end - start) * 1e6, 3),
                "args": args,
            })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "gradsync", "ranks": len(payloads)}}


def write_trace(path: str, payloads: list[dict]) -> str:
    """Write the merged trace atomically; returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text(path, json.dumps(chrome_trace(payloads)), "the trace")
    return path
