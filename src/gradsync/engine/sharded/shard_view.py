"""A flat shard as an optimizer sees it: one leaf tensor per parameter piece.

ZeRO (arXiv 1910.02054) shards flat buffers, so a rank's shard holds pieces of
several parameters. Stepping the flat shard as *one* optimizer tensor differs
from torch DDP in exactly one visible way: a parameter that got no gradient
would still be stepped (weight decay, momentum) and would share one Adam step
count with its neighbours. So the shard is exposed piece by piece: each
parameter's piece is a leaf tensor viewing the flat shard (updates land in the
flat buffer that the all-gather sends), with its own ``.grad`` -- a view of the
flat gradient shard, or None when no rank used that parameter -- and its own
optimizer state, as per-parameter sharding does in FSDP2.

For checkpoints that re-shard onto another world size, the pieces' optimizer
state is converted to flat per-element tensors over the shard's real elements
(:meth:`ShardView.flat_state`), and back (:meth:`ShardView.load_flat_state`):
a scalar such as Adam's ``step`` is repeated per element, and ``_present``
marks elements whose parameter had state, so the per-name re-assembly in
``checkpoint.py`` works unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .shards import FlatShard

PRESENT = "_present"


class ShardView:
    """The pieces of ``flat`` (this rank's shard of ``layout``) as optimizer tensors.

    ``as_parameter``: pieces are ``nn.Parameter`` (FSDP registers them on the
    module); otherwise plain leaf tensors (ZeroOptimizer's inner optimizer).
    A rank whose shard is only padding gets one empty piece, so an optimizer built
    on it is valid (a rank with nothing to shard still takes part).
    """

    def __init__(self, flat: torch.Tensor, layout: FlatShard, rank: int,
                 as_parameter: bool = False):
        self.flat, self.layout = flat, layout
        self.segments = layout.segments(rank)
        self.real = layout.real_numel(rank)
        make = nn.Parameter if as_parameter else (lambda t: t)
        with torch.no_grad():
            self.tensors = [make(flat[s.shard_offset:s.shard_offset + s.numel])
                            for s in self.segments] or [make(flat[0:0])]

    def param_indices(self) -> list[int]:
        """For each piece, the index of its parameter within the flat buffer."""
        return [s.param for s in self.segments]

    def assign_grads(self, grad: torch.Tensor | None, has_grad: Sequence[bool]) -> None:
        """Each piece's ``.grad``: its view of ``grad`` where its parameter has a gradient."""
        for t, s in zip(self.tensors, self.segments):
            if grad is None or not has_grad[s.param]:
                t.grad = None
            else:
                t.grad = grad[s.shard_offset:s.shard_offset + s.numel].to(t.dtype)
        if not self.segments:
            self.tensors[0].grad = None

    def clear_grads(self) -> None:
        for t in self.tensors:
            t.grad = None

    # ------------------------------------------------------------------ checkpoints
    def flat_state(self, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """(per-element state over the real elements, {scalar key: its type})."""
        n = self.real
        out: dict[str, torch.Tensor] = {PRESENT: torch.zeros(n, dtype=torch.float64)}
        kinds: dict[str, object] = {}
        for t, s in zip(self.tensors, self.segments):
            state = optimizer.state.get(t)
            if not state:
                continue
            lo, hi = s.shard_offset, s.shard_offset + s.numel
            out[PRESENT][lo:hi] = 1.0
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == s.numel:
                    dst = out.setdefault(key, torch.zeros(n, dtype=v.dtype))
                    dst[lo:hi] = v.reshape(-1)
                else:
                    kinds[key] = v.dtype if isinstance(v, torch.Tensor) else type(v)
                    dst = out.setdefault(key, torch.zeros(n, dtype=torch.float64))
                    dst[lo:hi] = float(v)
        return out, kinds

    def load_flat_state(self, optimizer, flat: dict[str, torch.Tensor],
                        kinds: dict[str, object]) -> None:
        """Rebuild each piece's optimizer state from :meth:`flat_state`'s output
        (possibly re-cut from another world size's shards)."""
        present = flat.get(PRESENT)
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for t, s in zip(self.tensors, self.segments):
            optimizer.state.pop(t, None)
            lo, hi = s.shard_offset, s.shard_offset + s.numel
            if present is None or s.numel == 0 or not float(present[lo]):
                continue
            state = {}
            scalar_device = _scalar_state_device(t, groups.get(id(t), {}))
            for key, v in flat.items():
                if key == PRESENT:
                    continue
                if key in kinds:
                    kind = kinds[key]
                    value = float(v[lo])
                    state[key] = (torch.tensor(value, dtype=kind, device=scalar_device)
                                  if isinstance(kind, torch.dtype) else kind(value))
                else:  # per-element state lives with its piece (a checkpoint loads on the host)
                    state[key] = v[lo:hi].to(t.device, copy=True)
            optimizer.state[t] = state


def _scalar_state_device(piece: torch.Tensor, group: dict) -> torch.device:
    """Where torch's optimizers keep a 0-dim state such as Adam's ``step``: on the host,
    unless the group is ``capturable`` or ``fused`` (then with the parameter), as
    ``torch.optim.Optimizer.load_state_dict`` places it."""
    if group.get("capturable") or group.get("fused"):
        return piece.device
    return torch.device("cpu")
