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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtype policy.

    param_dtype: dtype of the parameters forward and backward use (and of the
        gradients autograd produces).
    reduce_dtype: dtype gradients are summed across ranks in.
    cast_inputs: cast floating-point tensors passed to the model to ``param_dtype``.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    cast_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v not in _FLOATS:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {v!r}")


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
    """``"fp32"`` -> None (no policy), ``"bf16"`` / ``"fp16"`` -> a policy (CLI flag)."""
    table = {"fp32": None, "bf16": MixedPrecision(torch.bfloat16),
             "fp16": MixedPrecision(torch.float16)}
    if precision not in table:
        raise ValueError(f"precision must be one of {sorted(table)}, got {precision!r}")
    return table[precision]
