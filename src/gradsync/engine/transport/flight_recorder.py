"""The last N collectives of this process, written out when one of them fails.

Like NCCL's flight recorder (``TORCH_FR_BUFFER_SIZE``): a hang or a lost
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

On NCCL a collective does not fail on the host: ``wait()`` only makes the stream
wait, and a collective that never completes is found by NCCL's own watchdog, which
aborts the process at the timeout -- before any Python runs, so no record was
written and the hang report had nothing to read. There :func:`watch` starts a
thread that polls the works still in flight (``is_completed`` reads a CUDA event,
without blocking) and writes the ring, naming the stuck collective, once one has
been in flight for 3/4 of the timeout: before the abort, not after it.
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


_watching: list = []  # the watchdog thread, once started


def watching() -> bool:
    return bool(_watching)


def track(rec, work) -> None:
    """Keep ``work`` with its record while the watchdog runs (NCCL)."""
    if _watching and rec is not None and work is not None:
        rec.work = work


def watch(timeout_s: float, period_s: float | None = None) -> None:
    """Start the in-flight watchdog (once per process): NCCL collectives that have not
    completed on the device after ``0.75 * timeout_s`` get the ring written."""
    if _watching:
        return
    limit = 0.75 * timeout_s
    period = period_s if period_s is not None else max(0.5, min(10.0, limit / 4))

    def poll():
        while True:
            time.sleep(period)
            now = time.time()
            for rec in list(RING):
                work = rec.work
                if work is None:
                    continue
                with contextlib.suppress(Exception):
                    if work.is_completed():
                        rec.work = None  # its tensors are not kept alive any longer
                        continue
                    if now - rec.start > limit and rec.state != "failed":
                        rec.state = "failed"
                        failed_in_flight(rec, now - rec.start, timeout_s)

    thread = threading.Thread(target=poll, name="gradsync-flight-watchdog", daemon=True)
    _watching.append(thread)
    thread.start()


def failed_in_flight(rec, waited_s: float, timeout_s: float) -> None:
    exc = TimeoutError(f"not completed on the device after {waited_s:.0f} s (the collective "
                       f"timeout, {timeout_s:g} s, ends it)")
    with contextlib.suppress(Exception):
        path = dump(rec, exc)
        print(f"gradsync: rank {os.environ.get('RANK', '?')}: {rec.describe()} {exc}; "
              f"gradsync flight record of the last {len(RING)} collectives: {path}",
              file=sys.stderr, flush=True)


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
