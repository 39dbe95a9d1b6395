"""Compressed reductions on a communication thread, over a process group of their own.

A compressor's ``all_reduce_`` blocks (it computes between its messages), so a
caller that wants it to overlap with backward runs it on the engine's
communication thread (``transport/comm_thread.py``), over a private group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..transport import comm
from ..transport.comm_thread import CommThread, private_group
from .base import Compressor

__all__ = ["CompressionThread", "private_group"]


class CompressionThread:
    """Run ``compressor.all_reduce_`` calls in order on one background thread.

    ``comm_group``: the group the thread communicates on; default a
    :func:`private_group` of ``group``'s ranks, created here (every rank of
    ``group`` constructs a CompressionThread at the same point).
    """

    def __init__(self, compressor: Compressor, group=None, comm_group=None):
        self.compressor = compressor
        self.group = comm_group if comm_group is not None else private_group(group)
        self._thread = CommThread("gradsync-compress")

    def launch(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> comm.Pending:
        """Start reducing ``flat`` (which the caller leaves alone until ``wait()``)."""
        return self._thread.submit(self.compressor.all_reduce_, key, flat, shapes, self.group)

    def submit(self, fn, *args, **kwargs) -> comm.Pending:
        """Run ``fn`` on the same thread, after what was launched before."""
        return self._thread.submit(fn, *args, **kwargs)

    def close(self) -> None:
        """Wait for what was launched and stop the thread."""
        self._thread.close()
