"""Compressed reductions on a communication thread, over a process group of their own.

A compressor's ``all_reduce_`` blocks (it computes between its messages), so a
caller that wants it to overlap with backward runs it on a thread. Two rules keep
that safe: one thread, so reductions are issued in submission order on every
rank; and a process group no other thread uses, because two threads issuing
collectives on one group can order them differently on different ranks (a
mismatch, or a hang). :func:`private_group` makes that group.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from ...dist import default_timeout_s
from .. import comm
from .base import Compressor


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


class CompressionThread:
    """Run ``compressor.all_reduce_`` calls in order on one background thread.

    ``comm_group``: the group the thread communicates on; default a
    :func:`private_group` of ``group``'s ranks, created here (every rank of
    ``group`` constructs a CompressionThread at the same point).
    """

    def __init__(self, compressor: Compressor, group=None, comm_group=None):
        self.compressor = compressor
        self.group = comm_group if comm_group is not None else private_group(group)
        self._pool: ThreadPoolExecutor | None = None

    def launch(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> comm.Pending:
        """Start reducing ``flat`` (which the caller leaves alone until ``wait()``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gradsync-compress")
        future = self._pool.submit(self.compressor.all_reduce_, key, flat, shapes, self.group)
        return comm.Pending(_FutureWork(future), None)

    def close(self) -> None:
        """Wait for what was launched and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
