"""Mixed precision for plain DataParallel: bf16/fp16 compute, fp32 reduction and master weights.

The unsharded baseline of ZeRO's accounting (arXiv 1910.02054, section 3.1: 2 + 2 +
12 bytes per parameter, 16P): the module computes in ``param_dtype``; each bucket
is summed across ranks in ``reduce_dtype`` (a reduction strategy plugged into
DataParallel's ``set_reduction``, so hooks, order, ``num_items`` and ``no_sync``
are unchanged) and rounded once into the bf16 bucket; the optimizer steps a full
fp32 master copy and the result is cast back into the module's parameters.

fp16 adds dynamic loss scaling (``sync/loss_scale.py``, arXiv 1710.03740) and keeps
the fp32 sum itself as the gradient the masters step (:class:`MasterGradBuckets`):
the unscaled mean gradient rounded into fp16 would lose its small values. The
fp16 ``.grad`` of the module is its rounded copy, for reading; clip through
:meth:`MixedPrecisionOptimizer.clip_grad_norm_` (``gradsync train`` does), which
reaches the fp32 gradient. The sum exists at the end of backward anyway, so keeping
it until the step adds nothing to the peak: the step no longer casts a copy.
"""

from __future__ import annotations

import math

import torch

from ...errors import UsageError
from ..buckets.reduction import AllReduceBuckets
from ..sync.param_groups import module_param_groups
from .data_parallel import DataParallel
from .memory_report import MemoryReport, held, optimizer_bytes
from .precision import (
    MixedPrecision,
    cast_buffers_,
    cast_inputs_hook,
    load_inner_state,
    master_dtype,
)


class MasterGradBuckets(AllReduceBuckets):
    """Buckets summed in ``reduce_dtype`` whose wide sum stays the gradient (fp16).

    :class:`AllReduceBuckets` rounds the divided sum back into the bucket, which
    ``.grad`` views; this keeps the wide sum too (``wide``, per bucket, until the next
    window opens or the gradients are zeroed), with rules 1 and 2 applied to it as to
    the bucket, and hands each parameter's slice to the masters.
    """

    def __init__(self, reduce_dtype: torch.dtype):
        super().__init__(reduce_dtype)
        self.wide: dict[int, torch.Tensor] = {}

    def attach(self, dp) -> None:
        super().attach(dp)
        self._index = {id(p): i for i, p in enumerate(dp.trainable_params)}
        self.wide = {}

    def set_aside(self) -> None:
        self.wide = {}
        super().set_aside()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wide = {}

    def complete(self, divisor: float, used: list[bool]) -> None:
        for b in self.dp.buckets:
            src = self._src[b.spec.index]
            if src is not b.buffer:
                self.wide[b.spec.index] = src
        super().complete(divisor, used)

    def _restore(self, used: list[bool]) -> None:
        aside = dict(self._aside)
        super()._restore(used)
        for i, (g, copy) in aside.items():  # what the bucket got back, the wide sum too
            kept = copy if copy is not None else g
            w = self._slice(i)
            if w is None:
                continue
            if used[i]:
                w.add_(kept)
            else:
                w.copy_(kept)

    def _slice(self, i: int) -> torch.Tensor | None:
        bucket, slot = self.dp.where(i)
        wide = self.wide.get(bucket.spec.index)
        if wide is None:
            return None
        view = bucket.views[slot]
        start = view.storage_offset() - bucket.buffer.storage_offset()
        return wide[start:start + view.numel()].view_as(view)

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """``p``'s synchronised gradient in the wide dtype; its ``.grad`` when no sync
        left one (a step on gradients accumulated without a sync); None if it has none."""
        if p.grad is None:
            return None
        w = self._slice(self._index[id(p)])
        return p.grad if w is None else w

    def synced_grads(self) -> tuple[list[torch.Tensor], bool]:
        grads, sharded = super().synced_grads()
        return [self.wide.get(b.spec.index, g) for b, g in zip(self.dp.buckets, grads)], sharded

    def reset(self) -> None:
        super().reset()
        self.wide = {}


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """An fp32-master optimizer for a :class:`gradsync.DataParallel` computing in bf16 or fp16.

    Casts the module's floating-point parameters to ``mixed_precision.param_dtype``
    (the fp32 values are kept as masters first) and casts inputs unless told not to.
    With a ``loss_scale`` (fp16's default) the model scales its loss in
    ``backward(loss, num_items=n)``, and an overflowed step arrives with no gradients,
    so ``step()`` leaves masters and state as they are (``sync/loss_scale.py``).
    ``param_groups``: groups by parameter name (``sync/param_groups.py``), resolved to
    the masters.
    """

    def __init__(self, model: DataParallel, optimizer_class,
                 mixed_precision: MixedPrecision | None = None, param_groups=None,
                 **optimizer_kwargs):
        if not isinstance(model, DataParallel):
            raise UsageError("MixedPrecisionOptimizer wraps a gradsync.DataParallel")
        mp = mixed_precision or MixedPrecision()
        self.model, self.mixed_precision = model, mp
        self._params = [p for p in model.module.parameters() if p.requires_grad]
        self._masters = [p.detach().to(master_dtype(mp.param_dtype), copy=True)
                         for p in self._params]
        with torch.no_grad():
            for p in model.module.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(mp.param_dtype)
        cast_buffers_(model.module, mp.param_dtype)
        if mp.cast_inputs:
            model.module.register_forward_pre_hook(cast_inputs_hook(mp.param_dtype),
                                                   with_kwargs=True)
        self._wide = MasterGradBuckets(mp.reduce_dtype) if mp.wide_grads else None
        model.set_reduction(self._wide or AllReduceBuckets(mp.reduce_dtype))  # new buckets
        if mp.loss_scale is not None:
            model.use_loss_scale(mp.loss_scale)
        masters = (self._masters if param_groups is None else  # by name (sync/param_groups.py)
                   module_param_groups(model.module, param_groups, "MixedPrecisionOptimizer",
                                       self._masters))
        self.optimizer = optimizer_class(masters, **optimizer_kwargs)
        super().__init__(self._masters, dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UsageError("MixedPrecisionOptimizer.step() takes no closure")
        for p, m in zip(self._params, self._masters):
            g = self._grad(p)
            m.grad = None if g is None else g.to(m.dtype)
        self.optimizer.step()
        for p, m in zip(self._params, self._masters):
            p.copy_(m)
            m.grad = None

    def _grad(self, p) -> torch.Tensor | None:
        return p.grad if self._wide is None else self._wide.grad_of(p)

    @property
    def wide_grads(self) -> bool:
        """The masters step the wide (fp32) synchronised sum, not the parameters' ``.grad``."""
        return self._wide is not None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient the masters will step to global norm ``max_norm``; return the
        norm. Replicated, so no collective. With fp16 that gradient is the fp32 sum
        (``torch.nn.utils.clip_grad_norm_(model.parameters())`` would clip its fp16
        copy, which the step does not read); the copy is scaled alike."""
        if float(norm_type) != 2.0:
            raise ValueError("MixedPrecisionOptimizer.clip_grad_norm_ supports norm_type=2 only")
        if self._wide is None:
            if math.isinf(max_norm):  # only measure: no gradient rewritten (sharded/clip.py)
                return torch.nn.utils.get_total_norm(
                    [p.grad for p in self._params if p.grad is not None], 2.0)
            return torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        pairs = [(p, self._grad(p)) for p in self._params if p.grad is not None]
        if not pairs:  # an overflowed step: nothing to clip
            return torch.zeros((), dtype=torch.float32, device=self._masters[0].device
                               if self._masters else None)
        total = torch.zeros((), dtype=torch.float64, device=pairs[0][1].device)
        for _p, g in pairs:
            total += g.double().pow(2).sum()
        total = total.sqrt()
        if math.isinf(max_norm):
            return total.to(torch.float32)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p, g in pairs:
            g.mul_(coef.to(g.dtype))
            if g is not p.grad:
                p.grad.mul_(coef.to(p.grad.dtype))
        return total.to(torch.float32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"masters": [m.clone() for m in self._masters],
                "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for p, m, s in zip(self._params, self._masters, state["masters"]):
            m.copy_(s)
            p.copy_(s)
        load_inner_state(self, self.optimizer, state["optimizer"])

    def memory_report(self) -> MemoryReport:
        params = sum(held(p) for p in self.model.module.parameters())
        grads = sum(held(b.buffer) for b in self.model.buckets)
        if self._wide is not None:  # fp16: the fp32 sums kept between backward and step
            grads += sum(held(w) for w in self._wide.wide.values())
        master = sum(held(m) for m in self._masters)
        state = sum(optimizer_bytes(self.optimizer, m, m.numel())[0] for m in self._masters)
        return MemoryReport(0, self.model.world_size, sum(p.numel() for p in self._params),
                            params, grads, master, state, 0, 0)
