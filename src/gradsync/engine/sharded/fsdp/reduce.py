"""FSDP's gradient reductions: one fixed order on every rank, few unsharded gradients alive.

Autograd fires the units' gradient hooks in an order that can differ between ranks
(and between passes), but a collective must be entered in the same order on every
rank. So a unit's gradient, once accumulated, waits as ``ready`` until every unit
before it in ``order`` (reverse registration order, the root last) has launched;
then it is reduce-scattered to this rank's slice. At most ``MAX_INFLIGHT``
reductions are pending before the oldest is waited for and its unsharded gradient
dropped: that bound is ZeRO-3's gradient memory.

Under ``no_sync`` nothing is launched: gradients accumulate unsharded in ``acc``.
With HSDP (``replica_group``) each reduced slice is also summed across hosts.
Division by the global item count happens later, in ``FullyShardedDataParallel``.
"""

from __future__ import annotations

import torch

from ....errors import UsageError
from ...transport import comm
from .units import FlatUnit


class UnitReducer:
    MAX_INFLIGHT = 4  # gradient reductions in flight before waiting for the oldest

    def __init__(self, order: list[FlatUnit], shard_comm, rank: int, world: int, grad_group,
                 replica_group=None, reduce_dtype: torch.dtype | None = None):
        self.order, self.comm = order, shard_comm
        self.rank, self.world, self.group = rank, world, grad_group
        self.replica_group, self.reduce_dtype = replica_group, reduce_dtype
        self.start()

    def start(self) -> None:
        """A synchronised pass begins: reductions start again from the first unit."""
        self._next, self._inflight = 0, []
        for u in self.order:
            u.grad_seen = False

    def accept(self, u: FlatUnit, g: torch.Tensor, syncing: bool) -> None:
        """``u``'s gradient from this backward (a real one or zeros)."""
        if syncing and u.grad_seen:
            name = type(u.module).__name__
            raise UsageError(
                f"FullyShardedDataParallel: unit {u.index} ({name}) received its gradient twice "
                "in one synchronised backward: a module under reentrant activation "
                "checkpointing inside a larger unit. Make the checkpointed module a unit of its "
                "own (wrap=...) or use torch.utils.checkpoint(..., use_reentrant=False)")
        u.grad_seen = True
        g = g.to(self.reduce_dtype or g.dtype)
        if u.acc is not None:
            g = g + u.acc
        if not syncing:
            u.acc = g
            return
        u.acc, u.ready = None, g
        while self._next < len(self.order) and self.order[self._next].ready is not None:
            nxt = self.order[self._next]
            pending, part = self.comm.reduce(nxt.ready, self.rank, self.world, self.group,
                                             tag=f"grad{nxt.index}")
            nxt.reduced, nxt.ready = (pending, part), None
            self._next += 1
            self._inflight.append(nxt)
            while self._inflight and (len(self._inflight) > self.MAX_INFLIGHT
                                      or self._inflight[0].reduced[0].done()):
                self._finalize(self._inflight.pop(0))

    def unseen(self) -> list[FlatUnit]:
        """Units this backward did not reach, in reduction order (they contribute zeros)."""
        return [u for u in self.order if not u.grad_seen]

    def finish(self) -> None:
        """Wait for every reduction (and HSDP's cross-host sums): ``u.part`` is complete."""
        while self._inflight:
            self._finalize(self._inflight.pop(0))
        for u in self.order:
            if u.replica is not None:
                u.replica.wait()
                u.replica = None

    def _finalize(self, u: FlatUnit) -> None:
        """Keep ``u``'s reduced slice and drop the unsharded gradient."""
        pending, part = u.reduced
        pending.wait()
        u.part, u.reduced = part.clone(), None
        if self.replica_group is not None:  # HSDP: the same shard on every host, summed
            u.replica = comm.all_reduce(u.part, self.replica_group, async_op=True,
                                        tag=f"replica{u.index}")
