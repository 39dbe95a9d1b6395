"""How a DataParallel bucket travels, and how a synchronised backward ends for it.

DataParallel owns the hooks, the strict bucket launch order and the bucket
layout; a :class:`BucketReduction` owns the communication of a ready bucket and
what a finished sync leaves in the gradients. Implementations:

* :class:`AllReduceBuckets` (the default): sum each bucket over the ranks in place
  and divide -- DDP's all-reduce (arXiv 2006.15704, section 3.2); with
  ``reduce_dtype`` the sum runs in a wider dtype (bf16 compute, fp32 sums).
* ``ZeroOptimizer`` (``sharded/zero.py``): reduce each bucket to this rank's shard
  (ZeRO stages 1-2, arXiv 1910.02054).
* Subclasses of :class:`AllReduceBuckets` that override :meth:`communicate`:
  compressed or hierarchical sums.

The synchronised-backward core (``sync/core.py``) calls, per accumulation window:
``set_aside`` at its first pass (rule 2: gradients held from before must not be
summed again), ``take_back`` if that pass joined no parameter, then for a
synchronised pass ``launch`` per bucket and ``complete(divisor, used)`` once every
launched bucket has finished, with ``used[i]`` False for a parameter no rank used
(rule 1: it keeps the ``.grad`` it had).
"""

from __future__ import annotations

import torch

from ..transport import comm
from .buffer import Bucket
from .plan import BucketSpec

EXACT_SUM_DTYPES = (torch.float32, torch.float64)


class BucketReduction:
    """The protocol (with do-nothing defaults where that is a valid choice).

    ``piggyback``: buckets are summed in place, exactly for whole numbers, so small
    integer slots (the item-window header, the used mask) may ride at the end of a
    bucket buffer instead of costing collectives of their own.
    """

    piggyback = False
    repointed: frozenset | set = frozenset()  # parameters whose None .grad became a view
    owns_shards = False  # keeps state no other rank holds (ZeRO): join() needs its step
    exact_sum = False  # sums exactly (whole numbers survive): slots may ride in buckets

    def attach(self, dp) -> None:
        """Called once by DataParallel before its buckets are (re)built."""
        self.dp = dp

    def buffer_numel(self, spec: BucketSpec) -> int:
        return spec.numel

    def prepare(self) -> None:
        """Before gradients accumulate (a forward, or zero_grad)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``model.zero_grad()``: gradients the reduction holds (ZeRO's shards) go too."""

    def ensure(self, bucket: Bucket) -> None:
        """Before a gradient is copied into ``bucket`` (re-allocate released storage)."""

    def launch(self, bucket: Bucket) -> comm.Pending:
        raise NotImplementedError

    def set_aside(self) -> None:
        raise NotImplementedError

    def take_back(self) -> None:
        raise NotImplementedError

    def complete(self, divisor: float, used: list[bool]) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """A sync failed after communication: drop per-window state."""

    def synced_grads(self) -> tuple[list[torch.Tensor], bool]:
        """After :meth:`complete`: the synchronised gradient this rank holds, and whether
        it is sharded (different on every rank). Loss scaling checks it for overflow."""
        return [b.buffer[:b.spec.numel] for b in self.dp.buckets], False


class AllReduceBuckets(BucketReduction):
    """Sum every bucket over the ranks and divide; ``.grad`` stays a view into the bucket.

    reduce_dtype: sum in this dtype (e.g. fp32 for a bf16 model: bf16 sums lose low
    bits at every addition) and round once into the bucket.
    """

    exact_sum = True

    def __init__(self, reduce_dtype: torch.dtype | None = None):
        self.reduce_dtype = reduce_dtype
        self._src: dict[int, torch.Tensor] = {}
        self._aside: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._none: set[int] = set()  # parameters whose .grad was None when the window opened

    def attach(self, dp) -> None:
        super().attach(dp)
        dtypes = {p.dtype for p in dp.trainable_params}
        wide = self.reduce_dtype is not None and dtypes != {self.reduce_dtype}
        self.piggyback = not wide and self.exact_sum

    # -------------------------------------------------------------- communication
    def launch(self, bucket: Bucket) -> comm.Pending:
        buf = bucket.buffer
        rd = self.reduce_dtype
        src = buf if rd is None or rd == buf.dtype else buf.to(rd)
        self._src[bucket.spec.index] = src
        return self.communicate(bucket, src)

    def communicate(self, bucket: Bucket, src: torch.Tensor) -> comm.Pending:
        """Start summing ``src`` (the bucket, or its wide copy) over the ranks, in place."""
        return comm.all_reduce(src, self.dp.group, async_op=True,
                               tag=f"bucket{bucket.spec.index}",
                               meta={"bucket": bucket.spec.index, "params": len(bucket.params)})

    # -------------------------------------------------------------- the window's gradients
    def set_aside(self) -> None:
        """Rule 2: keep gradients held before this window out of the sum.

        A bucket whose every gradient is its own zeroed view (``zero_grad()`` without
        ``set_to_none``) needs nothing; anything else non-None is copied aside and the
        parameter's ``.grad`` set to None, so autograd hands over a fresh gradient that
        the hook copies into the bucket.
        """
        dp = self.dp
        self._aside = {}
        self._none = {i for i, p in enumerate(dp.trainable_params) if p.grad is None}
        self.repointed = set()
        for b in dp.buckets:
            grads = [p.grad for p in b.params]
            if all(g is None for g in grads):
                if b.zeroed and b.buffer.untyped_storage().nbytes():
                    # zeroed in place by zero_grad(set_to_none=True): autograd accumulates
                    # straight into the views (no fresh gradient, no copy into the bucket);
                    # a parameter no rank uses goes back to None at the sync (_none)
                    for i, p, view in zip(b.spec.params, b.params, b.views):
                        p.grad = view
                        self.repointed.add(i)
                continue
            if all(g is v for g, v in zip(grads, b.views)) and (
                    b.zeroed or not bool(b.buffer[:b.spec.numel].any())):
                continue
            for slot, g in enumerate(grads):
                if g is None:
                    continue
                i = b.spec.params[slot]
                view = b.views[slot]
                self._aside[i] = (g, g.detach().clone() if g is view else None)
                b.params[slot].grad = None

    def take_back(self) -> None:
        """No parameter joined the pass: nothing was written; restore the same tensors."""
        params = self.dp.trainable_params
        for i in self._none:  # re-pointed at a zeroed view by set_aside: None, as it was
            params[i].grad = None
        for i, (g, _copy) in self._aside.items():
            params[i].grad = g
        self._aside = {}

    def complete(self, divisor: float, used: list[bool]) -> None:
        for b in self.dp.buckets:
            src = self._src.pop(b.spec.index)
            src.div_(divisor)
            if src is not b.buffer:
                b.buffer.copy_(src)
        if self._aside or not all(used):
            self._restore(used)

    def _restore(self, used: list[bool]) -> None:
        """Rule 1 (unused everywhere: as before) and rule 2 (add back what was set aside)."""
        dp = self.dp
        aside, self._aside = self._aside, {}
        for i, p in enumerate(dp.trainable_params):
            kept = aside.get(i)
            bucket, slot = dp.where(i)
            view = bucket.views[slot]
            if used[i]:
                if kept is not None:
                    view.add_(kept[1] if kept[1] is not None else kept[0])
                continue
            if kept is None:
                if i in self._none:  # a zeroed view stays a zero gradient, as in DDP
                    p.grad = None
            elif kept[1] is not None:
                view.copy_(kept[1])
                p.grad = view
            else:
                p.grad = kept[0]

    def reset(self) -> None:
        self._src.clear()
        self._aside = {}
