"""clip_grad_norm_ over sharded gradients: the global norm, then the same scale everywhere.

With ZeRO each rank holds a slice of the gradient (arXiv 1910.02054), so a local
``torch.nn.utils.clip_grad_norm_`` would clip by the norm of a slice. The squared
norms of the shards are summed with one all-reduce; padding is zero and adds
nothing. The scale is torch's (``max_norm / (norm + 1e-6)``, clamped to 1), so a
sharded run clips exactly as one process on the whole batch does.
"""

from __future__ import annotations

import math

import torch

from ...errors import UsageError
from ..transport import comm


def clip_grad_norm_(target, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradient of ``target`` to global norm ``max_norm``; return the norm.

    ``target``: a ZeroOptimizer, a FullyShardedDataParallel, a DataParallel, a
    MixedPrecisionOptimizer (its own method: with fp16 the gradient it steps is the
    fp32 sum, not the parameters' ``.grad``) or any module/iterable of parameters
    (then torch's own function is used). An infinite ``max_norm`` only measures: no
    gradient is rewritten (torch's function would multiply every gradient by 1.0, a
    pass over all of them each step).
    """
    if float(norm_type) != 2.0:
        raise ValueError("gradsync.clip_grad_norm_ supports norm_type=2 only")
    shards_fn = getattr(target, "grad_shards", None)
    if shards_fn is None:  # a DataParallel whose reduction shards (ZeRO): its shards
        shards_fn = getattr(getattr(target, "_reduction", None), "grad_shards", None)
    if shards_fn is None:
        if getattr(target, "wide_grads", None) is not None:  # MixedPrecisionOptimizer
            return target.clip_grad_norm_(max_norm, norm_type)
        if isinstance(target, torch.optim.Optimizer):
            raise UsageError(f"clip_grad_norm_ takes a model, a ZeroOptimizer or parameters, "
                             f"not a {type(target).__name__}: pass the model")
        params = target.parameters() if hasattr(target, "parameters") else target
        if math.isinf(max_norm):
            return _total_norm([p.grad for p in params if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [g for g in shards_fn() if g is not None]
    if not grads:
        raise RuntimeError("clip_grad_norm_: no synchronised gradient yet (run a synced backward)")
    acc = torch.zeros(1, dtype=torch.float64, device=grads[0].device)
    for g in grads:
        acc += g.double().pow(2).sum()
    comm.all_reduce(acc, target.group, tag="clip_norm")
    total = acc.sqrt()
    if not math.isinf(max_norm):
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total.to(grads[0].dtype).squeeze(0)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over ``grads``, as torch's clip_grad_norm_ computes it (the same number)."""
    if not grads:
        return torch.tensor(0.0)
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
