"""What a stage-3 module attribute holds while its unit is sharded: a placeholder that
answers questions about the parameter but refuses to compute with it.

Between a unit's forward and its backward (and outside training) only this rank's
1/N slice of the unit exists, so ``module.weight`` cannot be the weight. A plain
meta tensor would keep shape and dtype, but torch lets some operations mix a meta
tensor with real ones and return a real tensor of garbage (``cpu @ meta`` does):
a model that uses a unit's parameter outside that unit's forward -- weight tying
written as ``h @ self.embed.weight.T`` in the parent, a norm logged after training
-- would silently compute with uninitialised memory. torch's FSDP2 hands out a
sharded DTensor there, which fails on use; this placeholder fails too, naming the
parameter, its unit, and what to do instead.

Metadata (shape, dtype, device, ``requires_grad``, ``numel()``...) still answers,
because models read it (``self.lm_head.weight.dtype``) without computing.
"""

from __future__ import annotations

import torch

from ....errors import UsageError

_T = torch.Tensor
_METADATA = frozenset({
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__,
    _T.requires_grad.__get__, _T.layout.__get__, _T.is_leaf.__get__, _T.grad.__get__,
    _T.is_meta.__get__, _T.is_cuda.__get__, _T.is_sparse.__get__, _T.itemsize.__get__,
    _T.size, _T.dim, _T.numel, _T.nelement, _T.element_size, _T.is_floating_point,
    _T.is_complex, _T.__len__, _T.__repr__, _T.__format__, _T.__hash__,
})


class ShardedParameter(torch.Tensor):
    """A sharded stage-3 parameter's stand-in (see the module docstring)."""

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, name: str, unit: str):
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t.parameter_name, t.unit_name = name, unit
        return t

    def __init__(self, *_args, **_kwargs):
        super().__init__()

    def __reduce_ex__(self, _protocol):  # pickle: another placeholder
        return ShardedParameter, (tuple(self.shape), self.dtype, self.parameter_name,
                                  self.unit_name)

    def __deepcopy__(self, memo):
        return ShardedParameter(tuple(self.shape), self.dtype, self.parameter_name,
                                self.unit_name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        holder = next(a for a in _flat(args, kwargs) if isinstance(a, ShardedParameter))
        raise UsageError(
            f"FullyShardedDataParallel: parameter {holder.parameter_name!r} was used "
            f"({getattr(func, '__name__', func)}) outside the forward of its unit "
            f"({holder.unit_name}), where only this rank's shard of it exists. Use it "
            "inside that module's forward, make the module that uses it the unit (wrap=), "
            "share it as a module attribute of both (tied weights belong to the root "
            "unit), or read values with model.full_state_dict()")


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from _flat(a, None)
        else:
            yield a
