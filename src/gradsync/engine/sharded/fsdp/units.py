"""Stage-3 units: which parameters are sharded together, and their flat buffers.

A unit is the granularity at which ZeRO-3 (arXiv 1910.02054, section 5.3) gathers
parameters: one flat buffer per wrapped module, padded to a multiple of N, of which
this rank keeps its 1/N slice (in the master dtype), which an optimizer steps
piece by piece (one ``nn.Parameter`` per parameter piece, ``shard_view.ShardView``).
The module's own parameters are deleted and become plain attributes that
``FullyShardedDataParallel`` points at views of the gathered buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from ....errors import UsageError
from ...replicated.precision import master_dtype
from ...sync.replicas import ignored_names
from ..shard_view import ShardView
from ..shards import FlatShard
from .placeholder import ShardedParameter


class FlatUnit:
    """One flat-sharded group of parameters and its gathered buffer."""

    def __init__(self, index, module, params, slots, world, rank, dtype, names, unit_name,
                 device: torch.device):
        self.index, self.module, self.slots = index, module, slots  # slots: [(mod, attr, k)]
        self.shapes = [p.shape for p in params]
        self.layout = FlatShard(tuple(p.numel() for p in params), world)
        start, end = self.layout.shard_range(rank)
        flat = torch.zeros(self.layout.padded, dtype=master_dtype(params[0].dtype), device=device)
        torch.cat([p.detach().reshape(-1).to(flat.dtype) for p in params],
                  out=flat[:self.layout.numel])
        self.shard = flat[start:end].clone()  # this rank's master slice (flat)
        self.view = ShardView(self.shard, self.layout, rank, as_parameter=True)
        self.full = torch.zeros(self.layout.padded, dtype=dtype, device=device, requires_grad=True)
        # what the module attributes hold while the unit is freed: never a view of freed
        # storage (reading one crashes); shape and dtype kept, computing with it an error
        self.freed = [ShardedParameter(s, dtype, n, unit_name)
                      for s, n in zip(self.shapes, names)]
        self.full.untyped_storage().resize_(0)
        self.gather_pending = None  # the Pending gather while one is in flight
        self.acc: torch.Tensor | None = None  # unsharded gradient under no_sync
        self.ready: torch.Tensor | None = None  # this pass's gradient, waiting to launch
        self.reduced = None  # (Pending, slice, source) of the launched reduction
        self.part: torch.Tensor | None = None  # reduced slice, not yet divided
        self.replica = None  # HSDP: the cross-host all-reduce of ``part`` in flight
        self.grad: torch.Tensor | None = None  # this rank's slice of the synced gradient
        self.has_grad = [False] * len(params)  # per parameter: .grad after the sync
        self.aside: tuple[torch.Tensor, list[bool]] | None = None  # from before the window
        self.used = [False] * len(params)  # got a gradient in the open window (this rank)
        self.joined = [False] * len(params)  # got a gradient (or zeros) in this pass
        self.grad_seen = False
        self.bw_gathered = False
        self.kept = False  # gathered in forward and kept for its backward

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per parameter, viewing its place in a flat buffer of this unit."""
        pieces = flat[:self.layout.numel].split(list(self.layout.numels))
        return [p.view(s) for p, s in zip(pieces, self.shapes)]

    def param_views(self, grad: bool) -> list[torch.Tensor]:
        """The module-facing parameters: views of the gathered buffer, differentiable
        into ``full`` when ``grad``."""
        if grad:
            return list(UnflattenParams.apply(self.full, self))
        return self.views_of(self.full.detach())


class UnflattenParams(torch.autograd.Function):
    """A unit's flat buffer -> one view per parameter, with a backward that writes the
    parameters' gradients straight into one fresh flat gradient.

    Autograd through ``full[:numel].split(...)`` would build the same flat gradient
    in three passes (zero-filled buffer for the slice, a concatenation for the split,
    a copy between them); this is one pass, plus zeroing the padding tail.
    """

    @staticmethod
    def forward(ctx, full, unit):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # None for a parameter the forward did not use
        return tuple(unit.views_of(full))

    @staticmethod
    def backward(ctx, *grads):
        u = ctx.unit
        for k, g in enumerate(grads):
            if g is not None:
                u.joined[k] = True
        flat = torch.empty(u.layout.padded, dtype=grads[0].dtype if grads[0] is not None
                           else u.full.dtype, device=u.full.device)
        for piece, g in zip(u.views_of(flat), grads):
            if g is None:  # a parameter that took no part in this forward
                piece.zero_()
            else:  # a sparse gradient (nn.Embedding(sparse=True)) lands dense
                piece.copy_(g.to_dense() if g.layout != torch.strided else g)
        flat[u.layout.numel:].zero_()
        return flat, None


def build_units(module: nn.Module, wrap, world: int, rank: int,
                param_dtype: torch.dtype | None, device: torch.device | None = None
                ) -> list[FlatUnit]:
    """Choose units, assign every trainable parameter to one, replace them by attributes.

    ``wrap``: module classes (a class, set or tuple) or a predicate. A parameter used
    by two units (tied weights) goes to the root, which is gathered for the whole
    forward. Units come in registration (pre-)order, the root first. Every buffer
    lives on ``device``, the communication device (default: the parameters').
    """
    ignored = ignored_names(module)
    if ignored:
        raise UsageError("FullyShardedDataParallel shards every parameter; this module sets "
                         f"torch DDP's parameters to ignore ({sorted(ignored)[:3]}): use "
                         "gradsync.DataParallel, which leaves them alone as DDP does")
    if isinstance(wrap, type):
        wrap = (wrap,)
    is_unit = wrap if callable(wrap) and not isinstance(wrap, type) else (
        lambda m: isinstance(m, tuple(wrap or ())))
    owner_of: dict[nn.Module, nn.Module] = {module: module}
    for m in module.modules():  # pre-order: a parent's owner is known before its children
        for child in m.children():
            owner_of.setdefault(child, child if is_unit(child) else owner_of[m])
    order = [m for m in module.modules() if owner_of[m] is m]  # units in pre-order
    params: dict[int, nn.Parameter] = {}
    owners: dict[int, set] = {}
    slots: dict[int, list] = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is None or not p.requires_grad:
                continue
            params[id(p)] = p
            owners.setdefault(id(p), set()).add(owner_of[m])
            slots.setdefault(id(p), []).append((m, attr))
    per_unit: dict[nn.Module, list[int]] = {}
    for pid in params:
        own = owners[pid]
        per_unit.setdefault(next(iter(own)) if len(own) == 1 else module, []).append(pid)
    for m, pids in per_unit.items():  # before any module is changed
        _check_one_dtype(module, m, [params[i] for i in pids])
    dtype = param_dtype
    if device is None:
        device = next((p.device for p in params.values()), torch.device("cpu"))
    qualified = {id(m): n for n, m in module.named_modules()}
    units = []
    for m in order:
        pids = per_unit.get(m)
        if not pids:
            continue
        plist = [params[i] for i in pids]
        us = [(mod, attr, k) for k, i in enumerate(pids) for mod, attr in slots[i]]
        names = [".".join(filter(None, (qualified[id(slots[i][0][0])], slots[i][0][1])))
                 for i in pids]
        unit_name = f"unit {qualified[id(m)]!r}" if m is not module else "the root unit"
        units.append(FlatUnit(len(units), m, plist, us, world, rank,
                              dtype or plist[0].dtype, names, unit_name, device))
        for mod, attr, k in us:
            del mod._parameters[attr]
            setattr(mod, attr, units[-1].freed[k])
    return units


def _check_one_dtype(root: nn.Module, unit: nn.Module, params: list[nn.Parameter]) -> None:
    """A unit is one flat buffer of one dtype: refuse to round (or widen) a parameter."""
    if len({p.dtype for p in params}) < 2:
        return
    name = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
    where = next((n for n, m in root.named_modules() if m is unit), "") or "the root"
    mixed = ", ".join(f"{name.get(id(p), '?')} ({str(p.dtype).replace('torch.', '')})"
                      for p in params)
    raise UsageError(f"FullyShardedDataParallel: unit {where} ({type(unit).__name__}) mixes "
                     f"parameter dtypes: {mixed}. A unit is one flat buffer of one dtype: "
                     f"cast the model to one dtype, or make each dtype's modules units of "
                     f"their own with wrap=")


def slot_names(root: nn.Module, unit: FlatUnit) -> list[str]:
    """The original (state-dict) name of every place a unit's parameters lived."""
    where = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    return [f"{where[id(mod)]}.{attr}".lstrip(".") for mod, attr, _k in unit.slots]


def first_names(root: nn.Module, unit: FlatUnit) -> list[str]:
    """One (state-dict) name per parameter of ``unit``: the first place it lived."""
    first: dict[int, str] = {}
    for (_m, _a, k), name in zip(unit.slots, slot_names(root, unit)):
        first.setdefault(k, name)
    return [first[k] for k in range(len(unit.shapes))]
