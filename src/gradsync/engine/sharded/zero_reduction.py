"""ZeroOptimizer's half that DataParallel drives during backward: its bucket reduction.

DataParallel owns the hooks, the strict bucket launch order and the ``num_items``
window; a :class:`~gradsync.engine.buckets.reduction.BucketReduction` says how a
ready bucket travels and what the end of backward leaves behind. ZeRO's answer
(arXiv 1910.02054, sections 5.1-5.2): a bucket is *reduced to shards*
(``transport/shard_comm.py``) and the end of backward divides this rank's slice
by the global item count. Stage 1 keeps the slice in the persistent bucket
buffer; stage 2 frees each bucket once its reduction has completed (waiting for
the oldest when more than ``MAX_INFLIGHT`` are pending), so only a few buckets
exist during backward and only the 2P/N gradient slice between backward and step.

A mixin of :class:`~gradsync.engine.sharded.zero.ZeroOptimizer`: it reads the
optimizer's ``_shards`` (:class:`~gradsync.engine.sharded.zero_shard.BucketShard`),
``stage``, ``comm``, ``rank``, ``world``, ``group``, ``mixed_precision``, ``model``
and the ``_synced`` / ``_stepped`` flags, which ZeroOptimizer sets up.

With fp16 parameters the divided slice stays in ``reduce_dtype`` (fp32) instead of
being rounded into the bucket's dtype (``MixedPrecision.wide_grads``): loss scaling
has already been divided out, and fp16 would lose the small values of the unscaled
mean. The slice is 1/N of the bucket, so this costs 2 bytes per parameter over N.
"""

from __future__ import annotations

import warnings

import torch

from ..buckets.reduction import BucketReduction
from .shards import FlatShard
from .zero_shard import BucketShard


class ZeroReduction(BucketReduction):
    """Reduce buckets to this rank's shard; keep the result in ``BucketShard.grad``."""

    MAX_INFLIGHT = 3  # stage 2: bucket reductions pending before backward waits

    def attach(self, dp) -> None:
        self.dp = dp

    def buffer_numel(self, spec) -> int:
        return FlatShard((spec.numel,), self.world).padded

    def ensure(self, bucket) -> None:
        """(Re-)allocate a bucket released after an earlier reduction (stage 2)."""
        buf = bucket.buffer
        storage = buf.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(buf.numel() * buf.element_size())
            buf.zero_()

    def launch(self, bucket):
        s = self._shards[bucket.spec.index]
        rd = self._reduce_dtype(bucket.buffer.dtype)
        s.src = bucket.buffer if rd == bucket.buffer.dtype else bucket.buffer.to(rd)
        s.pending, s.reduced = self.comm.reduce(s.src, self.rank, self.world, self.group,
                                                tag=f"bucket{bucket.spec.index}")
        if self.stage == 2:  # release earlier buckets whose reduction completed; beyond
            inflight = [t for t in self._shards[:bucket.spec.index] if t.pending is not None]
            for k, t in enumerate(inflight):  # MAX_INFLIGHT pending, wait for the oldest
                if t.pending.done() or len(inflight) - k > self.MAX_INFLIGHT:
                    self._release(t)
        return s.pending

    def _release(self, s: BucketShard) -> None:
        """Stage 2: keep the reduced slice, free the bucket (its gradients are used up)."""
        s.pending.wait()  # already complete: no blocking, but it notifies observers
        s.partial = s.reduced.clone()
        s.reduced = s.src = s.pending = None
        for p in s.bucket.params:
            p.grad = None
        s.bucket.buffer.untyped_storage().resize_(0)

    def set_aside(self) -> None:
        """Rule 2: gradient shards synced before this window are kept out of its sum."""
        if not self._synced:
            return
        if self._stepped and not self._warned_kept:
            self._warned_kept = True
            warnings.warn(
                "ZeroOptimizer: the gradients of the last step are still held (no "
                "optimizer.zero_grad() or model.zero_grad() since step()), so this backward "
                "adds to them, as torch accumulates .grad. If you meant to clear them: "
                "module.zero_grad() on the unwrapped module does not reach ZeRO's gradient "
                "shards; call the optimizer's or the wrapper's zero_grad()", stacklevel=2)
        for s in self._shards:
            s.aside = None if s.grad is None else (s.grad.clone(), list(s.has_grad))
        self._synced = False

    def take_back(self) -> None:
        if any(s.aside is not None for s in self._shards):
            for s in self._shards:
                s.aside = None
            self._synced = True

    def complete(self, divisor: float, used: list[bool]) -> None:
        wide = self.mixed_precision is not None and self.mixed_precision.wide_grads
        for s in self._shards:
            if self.stage == 1 and not wide:
                red, target = s.reduced, s.bucket.buffer[s.start:s.end]
                if red.data_ptr() == target.data_ptr():
                    target.div_(divisor)
                else:
                    target.copy_(red.div_(divisor))
                s.grad = target
            else:
                part = s.partial if s.partial is not None else s.reduced
                part.div_(divisor)
                s.grad = _own(part) if wide else part.to(s.bucket.buffer.dtype, copy=True)
            s.has_grad = [used[i] for i in s.bucket.spec.params]
            if s.aside is not None:
                s.grad.add_(s.aside[0])
                s.has_grad = [a or b for a, b in zip(s.has_grad, s.aside[1])]
            s.aside = s.reduced = s.src = s.pending = s.partial = None
        for p in self.model.parameters():
            p.grad = None  # local, unreduced values: not a gradient anyone should read
        if self.stage == 2:
            for s in self._shards:
                s.bucket.buffer.untyped_storage().resize_(0)
        self._synced = True

    def grad_used(self) -> list[bool]:
        """Whether each parameter (bucket by bucket) has a synchronised gradient."""
        return [u for s in self._shards for u in s.has_grad]

    def set_grad_used(self, used: list[bool]) -> None:
        """Mark parameters as having a (zero, where nobody here used them) gradient: a
        replica group none of whose ranks used a parameter another group used must step
        it too, on the quorum's sum (``ft/cross_reduce.py``)."""
        flags = iter(used)
        for s in self._shards:
            s.has_grad = [next(flags) for _ in s.has_grad]

    def reset(self) -> None:
        for s in self._shards:
            s.reduced = s.src = s.pending = s.partial = None

    def synced_grads(self) -> tuple[list[torch.Tensor], bool]:
        """This rank's gradient shards: a different piece on every rank."""
        return [s.grad for s in self._shards if s.grad is not None], True

    def _reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.mixed_precision.reduce_dtype if self.mixed_precision else dtype


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own size (a slice of a whole reduced bucket would keep the
    bucket alive)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()
