"""The last N collectives of this process, written out when one of them fails.

Like NCCL's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``): a hang or a lost
peer ends in a backend error on the ranks that were waiting ("Timed out waiting
3000ms for recv operation", "Connection closed by peer") that names neither the
collective nor the rank that did not come. ``comm.py`` numbers every collective
(``fingerprint.note``) and keeps it here, in a ring of :data:`SIZE` records:
sequence number per group, op, tag, dtype, element count, bytes,
start and end (wall clock, so ranks' records compare). When a collective raises,
the ring is written as JSON to ``hang_report.flight_path(rank)`` (the run's
flight directory; one line on stderr says where), and the launcher's hang
report (``gradsync/hang_report.py``) reads every rank's file and says which rank
is behind and at which collective.

Cost: one small object and a deque append per collective; nothing is written
unless a collective fails.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import sys
import threading
import time

from ... import hang_report
from . import fingerprint

SIZE = 64
RING: collections.deque = collections.deque(maxlen=SIZE)
_dump_lock = threading.Lock()


def begin(op: str, tensor, group, tag: str):
    rec = fingerprint.note(op, tensor, group, tag, time.time())
    RING.append(rec)
    return rec


def end(rec) -> None:
    if rec is not None:
        rec.end = time.time()
        rec.state = "completed"


def failed(rec, exc: BaseException) -> None:
    """``rec`` raised ``exc``: write the ring (once per process) and say where."""
    if rec is None:
        return
    rec.state = "failed"
    with contextlib.suppress(Exception):
        path = dump(rec, exc)
        note = f"gradsync flight record of the last {len(RING)} collectives: {path}"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        rank = os.environ.get("RANK", "?")
        print(f"gradsync: rank {rank}: {rec.describe()} failed after "
              f"{time.time() - rec.start:.1f} s; {note}", file=sys.stderr, flush=True)


def snapshot(stuck=None, error: str = "") -> dict:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"rank": rank, "world": world, "pid": os.getpid(), "host": socket.gethostname(),
            "time": time.time(), "error": error,
            "stuck": None if stuck is None else stuck.as_dict(),
            "records": [r.as_dict() for r in list(RING)]}


def dump(stuck=None, exc: BaseException | None = None) -> str:
    """Write this rank's records (and the one it was waiting in) as JSON; the path."""
    first = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
    data = snapshot(stuck, f"{type(exc).__name__}: {first}" if exc is not None else "")
    path = hang_report.flight_path(data["rank"])
    with _dump_lock:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    return path
