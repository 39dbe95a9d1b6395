"""Gathering and freeing stage-3 units: when a unit's full parameters exist.

A unit's gathered buffer is the dominant transient memory of ZeRO-3 (arXiv
1910.02054, section 5.3), so it exists only between a gather and the matching
free. Gathers are issued on one process group in one order on every rank
(forward in registration order, backward in reverse), prefetched ``prefetch``
units ahead so communication overlaps compute; storage is re-filled in place, so
tensors autograd saved during forward see the values again in backward.
"""

from __future__ import annotations

import torch

from .fsdp_units import FlatUnit


class UnitGatherer:
    """Gathers, frees and prefetches the units of one FullyShardedDataParallel."""

    def __init__(self, units: list[FlatUnit], comm, group, rank: int, prefetch: int):
        self.units, self.comm, self.group, self.rank = units, comm, group, rank
        self.prefetch = prefetch

    def launch(self, u: FlatUnit) -> None:
        """Start gathering ``u`` unless it is gathered or on its way."""
        if u.gather_pending is not None or u.full.untyped_storage().nbytes():
            return
        full = u.full.data
        full.untyped_storage().resize_(full.numel() * full.element_size())
        u.gather_pending = self.comm.gather(full, u.shard, self.rank, self.group,
                                            tag=f"unit{u.index}")

    def gather(self, u: FlatUnit, grad: bool) -> None:
        """Make ``u``'s module attributes views of its full parameters (differentiable
        into the flat buffer when ``grad``)."""
        self.launch(u)
        if u.gather_pending is not None:
            u.gather_pending.wait()
            u.gather_pending = None
        views = u.param_views(grad)
        for mod, attr, k in u.slots:
            setattr(mod, attr, views[k])

    def free(self, u: FlatUnit) -> None:
        """Release ``u``'s full buffer; a gather still in flight (prefetched for a unit
        the forward then skipped) completes first, it is writing into that storage."""
        if u.gather_pending is not None:
            u.gather_pending.wait()
            u.gather_pending = None
        u.kept = False
        u.full.untyped_storage().resize_(0)

    def prefetch_after(self, u: FlatUnit, backward: bool, root: torch.nn.Module) -> None:
        seq = self.units[::-1] if backward else self.units
        pos = seq.index(u)
        for nxt in seq[pos + 1:pos + 1 + self.prefetch]:
            if nxt.module is not root:
                self.launch(nxt)

    def release_all(self) -> None:
        """Free whatever an earlier forward or pass left gathered."""
        for u in self.units:
            if u.full.untyped_storage().nbytes():
                self.free(u)
