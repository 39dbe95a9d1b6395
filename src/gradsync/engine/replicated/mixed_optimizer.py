"""Mixed precision for plain DataParallel: bf16 compute, fp32 reduction and master weights.

The unsharded baseline of ZeRO's accounting (arXiv 1910.02054, section 3.1: 2 + 2 +
12 bytes per parameter, 16P): the module computes in ``param_dtype``; each bucket
is summed across ranks in ``reduce_dtype`` (a reduction strategy plugged into
DataParallel's ``set_reduction``, so hooks, order, ``num_items`` and ``no_sync``
are unchanged) and rounded once into the bf16 bucket; the optimizer steps a full
fp32 master copy and the result is cast back into the module's parameters.
"""

from __future__ import annotations

import torch

from ...errors import UsageError
from ..buckets.reduction import AllReduceBuckets
from .data_parallel import DataParallel
from .memory_report import MemoryReport, held, optimizer_bytes
from .precision import MixedPrecision, cast_buffers_, cast_inputs_hook


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """An fp32-master optimizer for a :class:`gradsync.DataParallel` computing in bf16.

    Casts the module's floating-point parameters to ``mixed_precision.param_dtype``
    (the fp32 values are kept as masters first) and casts inputs unless told not to.
    """

    def __init__(self, model: DataParallel, optimizer_class,
                 mixed_precision: MixedPrecision | None = None, **optimizer_kwargs):
        if not isinstance(model, DataParallel):
            raise UsageError("MixedPrecisionOptimizer wraps a gradsync.DataParallel")
        mp = mixed_precision or MixedPrecision()
        self.model, self.mixed_precision = model, mp
        self._params = [p for p in model.module.parameters() if p.requires_grad]
        self._masters = [p.detach().to(torch.float32, copy=True) for p in self._params]
        with torch.no_grad():
            for p in model.module.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(mp.param_dtype)
        cast_buffers_(model.module, mp.param_dtype)
        if mp.cast_inputs:
            model.module.register_forward_pre_hook(cast_inputs_hook(mp.param_dtype),
                                                   with_kwargs=True)
        model.set_reduction(AllReduceBuckets(mp.reduce_dtype))  # re-creates buckets
        self.optimizer = optimizer_class(self._masters, **optimizer_kwargs)
        super().__init__(self._masters, dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UsageError("MixedPrecisionOptimizer.step() takes no closure")
        for p, m in zip(self._params, self._masters):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
        self.optimizer.step()
        for p, m in zip(self._params, self._masters):
            p.copy_(m)
            m.grad = None

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
        self.optimizer.load_state_dict(state["optimizer"])

    def memory_report(self) -> MemoryReport:
        params = sum(held(p) for p in self.model.module.parameters())
        grads = sum(held(b.buffer) for b in self.model.buckets)
        master = sum(held(m) for m in self._masters)
        state = sum(optimizer_bytes(self.optimizer, m, m.numel())[0] for m in self._masters)
        return MemoryReport(0, self.model.world_size, sum(p.numel() for p in self._params),
                            params, grads, master, state, 0, 0)
