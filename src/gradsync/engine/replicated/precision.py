"""MixedPrecision: compute in a low-precision dtype, keep fp32 master weights.

ZeRO (arXiv 1910.02054, section 3.1) assumes mixed-precision Adam: fp16/bf16
parameters and gradients for forward and backward (2 + 2 bytes per parameter) and
an fp32 master copy plus fp32 moments in the optimizer (12 bytes, k = 12). The
sharded strategies keep the fp32 master in this rank's shard only and cast it to
``param_dtype`` when parameters are gathered.

``reduce_dtype`` is the dtype gradients are summed in. bf16 has an 8-bit mantissa:
summing many ranks' bf16 gradients in bf16 loses low bits at every addition (the
"bf16 reduction instability" users report), so the default reduces in fp32 and
rounds once afterwards.

fp16 has bf16's mantissa and more, but a 5-bit exponent: small gradients underflow
in backward. ``param_dtype=torch.float16`` therefore comes with dynamic loss scaling
(``loss_scale``, ``sync/loss_scale.py``; arXiv 1710.03740), and its reduced gradient
stays in ``reduce_dtype`` until the fp32 master takes it (rounded back into fp16,
an unscaled mean gradient below 2**-14 would lose bits and below 2**-24 vanish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import UsageError
from ..sync.loss_scale import LossScale

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtype policy.

    param_dtype: dtype of the parameters forward and backward use (and of the
        gradients autograd produces).
    reduce_dtype: dtype gradients are summed across ranks in.
    cast_inputs: cast floating-point tensors passed to the model to ``param_dtype``.
    loss_scale: a :class:`LossScale` (the loss is scaled inside ``backward(loss,
        num_items=n)`` and divided out at the sync; an overflowing step is skipped on
        every rank). None: the dtype's default -- ``LossScale()`` for float16, none
        for the others (bf16 has fp32's exponent range; a scale may still be given).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    cast_inputs: bool = True
    loss_scale: LossScale | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v not in _FLOATS:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {v!r}")
        if self.loss_scale is None and self.param_dtype == torch.float16:
            object.__setattr__(self, "loss_scale", LossScale())
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScale):
            raise UsageError(f"MixedPrecision.loss_scale must be a gradsync.LossScale or None, "
                             f"got {self.loss_scale!r}")
        if self.param_dtype == torch.float16 and self.reduce_dtype == torch.float16:
            raise UsageError("MixedPrecision(param_dtype=float16) reduces in float32 or float64: "
                             "an fp16 sum of loss-scaled gradients overflows and its unscaled "
                             "mean underflows; leave reduce_dtype at its default")

    @property
    def wide_grads(self) -> bool:
        """The synchronised gradient stays in ``reduce_dtype`` rather than being rounded
        into the parameters' dtype: fp16 (see the module docstring)."""
        return self.param_dtype == torch.float16


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 master weights for low-precision parameters; fp32/fp64 keep their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _cast(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def cast_buffers_(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers to the compute dtype, in place (the same tensor objects).

    BatchNorm's kernels want its running statistics in the dtype of its weight, which
    mixed precision casts: fp32 statistics beside a bf16 weight are an error. They are
    kept in the compute dtype, as the parameters the forward sees are.
    """
    with torch.no_grad():
        for b in module.buffers():
            if b.is_floating_point() and b.dtype != dtype:
                b.data = b.data.to(dtype)


def cast_frozen_params_(module: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters to the compute dtype, in place.

    Stage 3 shards (and keeps fp32 masters of) trainable parameters only; a frozen
    fp32 weight left beside bf16 activations makes its layer's forward a dtype error.
    DataParallel's and ZeRO's mixed precision cast every parameter, frozen ones
    included, and stage 3 does the same for the ones it does not shard.
    """
    with torch.no_grad():
        for p in module.parameters():
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def cast_inputs_hook(dtype: torch.dtype):
    """A forward pre-hook (with kwargs) casting floating-point inputs to ``dtype``."""
    def hook(module: nn.Module, args, kwargs):
        return _cast(args, dtype), _cast(kwargs, dtype)
    return hook


def parse_precision(precision: str) -> MixedPrecision | None:
    """``"fp32"`` -> None (no policy), ``"bf16"`` / ``"fp16"`` -> a policy (CLI flag);
    fp16's carries the default :class:`LossScale`."""
    table = {"fp32": None, "bf16": MixedPrecision(torch.bfloat16),
             "fp16": MixedPrecision(torch.float16)}
    if precision not in table:
        raise ValueError(f"precision must be one of {sorted(table)}, got {precision!r}")
    return table[precision]


def load_inner_state(outer: torch.optim.Optimizer, inner: torch.optim.Optimizer,
                     state: dict) -> None:
    """``inner.load_state_dict(state)`` for an optimizer that steps a master copy
    (:class:`MixedPrecisionOptimizer`, ZeRO's), keeping the group and state objects
    that ``outer`` shares with ``inner``.

    torch's ``load_state_dict`` gives the inner optimizer new ``param_groups`` and
    ``state`` objects; an LR scheduler sets the lr in the *outer* ones, so those are
    refilled with what was loaded and handed back (else every step after a resume kept
    the saved step's lr)."""
    groups, kept = outer.param_groups, outer.state
    inner.load_state_dict(state)
    for mine, loaded in zip(groups, inner.param_groups):
        mine.clear()
        mine.update(loaded)
    kept.clear()
    kept.update(inner.state)
    inner.param_groups, inner.state = groups, kept
