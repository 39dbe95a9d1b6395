"""Blocking collectives run in order on one background thread, as overlapped work.

Reference algorithms (``algorithms/``) and compressors (``compress/``) block: they
compute between their messages. To overlap them with backward, as an async
all-reduce overlaps, they run on a communication thread. Two rules keep that
safe: one thread per owner, so operations are issued in submission order on
every rank; and process groups no other thread uses, because two threads issuing
collectives on one group can order them differently on different ranks (a
mismatch, or a hang). :func:`private_group` makes such a group.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist

from ...dist import default_timeout_s
from . import comm


def private_group(group=None):
    """A new process group with the ranks of ``group`` (only those ranks call this),
    with gradsync's collective timeout."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return dist.new_group(ranks, timeout=timedelta(seconds=default_timeout_s()),
                          use_local_synchronization=True)


class _FutureWork:
    """What ``comm.Pending`` needs from a work object, for a thread's future."""

    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()  # re-raises the thread's exception here

    def is_completed(self) -> bool:
        return self._future.done()


class CommThread:
    """Runs submitted blocking calls one at a time, in submission order."""

    def __init__(self, name: str = "gradsync-comm"):
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn, *args, **kwargs) -> comm.Pending:
        """Start ``fn(*args, **kwargs)`` after everything submitted before; its
        ``wait()`` re-raises what ``fn`` raised."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        return comm.Pending(_FutureWork(self._pool.submit(fn, *args, **kwargs)), None)

    def close(self) -> None:
        """Wait for what was submitted and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
