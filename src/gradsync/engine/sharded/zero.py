"""ZeroOptimizer: ZeRO stages 1 and 2 (arXiv 1910.02054, sections 5.1-5.2) over DataParallel.

Every bucket of the wrapped :class:`~gradsync.DataParallel` becomes a flat buffer
padded to a multiple of N and cut into N equal shards (:class:`BucketShard`, below).
Rank r owns slice r of every bucket: the master weights of that slice (a separate
fp32 copy for bf16/fp16 parameters; for fp32/fp64 parameters the slice of the flat
parameter buffer itself) and the inner optimizer's state for it (stage 1:
optimizer state 12P/N with mixed-precision Adam).

Backward is DataParallel's, unchanged: same hooks, same strict bucket launch order,
same ``num_items`` window count, same ``no_sync``, same DDP-compatibility rules
(``sync/core.py``). This class is DataParallel's bucket reduction
(:class:`ZeroReduction`, below): a ready bucket is reduced to shards and the end
of backward divides this rank's slice by the global item count. After a
synchronised backward this rank holds exactly its slice of the global-mean gradient
(``grad_shards()``; ``param.grad`` is None); a further synchronised window before
``step()`` adds its own mean to it, as gradients accumulate under torch DDP. Under
``no_sync`` every bucket lives for the whole accumulation window.

``step()`` runs the inner optimizer on this rank's pieces of the parameters (one
tensor per parameter piece, ``shard_view.ShardView``: a parameter no rank used
has no gradient and is not stepped, exactly as in torch DDP), then all-gathers
the updated parameters bucket by bucket into flat parameter buffers that the
module's parameters are views of, so every replica holds bitwise the same values.

The inner optimizer must be elementwise: the update of an element may depend only
on that element's own parameter, gradient and state (a piece is part of a tensor).
Allowed: :data:`ELEMENTWISE`; a custom optimizer opts in with a class
attribute ``gradsync_elementwise = True``.

One bucket as ZeRO shards it: the flat parameter buffer and this rank's slices.

ZeRO stages 1 and 2 (arXiv 1910.02054, sections 5.1-5.2) cut every DataParallel
bucket into N equal pieces (``shards.FlatShard``); rank r keeps the master weights
of piece r (a separate fp32 copy for bf16/fp16 parameters, else the piece of the
flat buffer itself) and its slice of the synchronised gradient. Also here: the
check that the inner optimizer is elementwise, the condition for stepping pieces
of tensors.

ZeroOptimizer's half that DataParallel drives during backward: its bucket reduction.

DataParallel owns the hooks, the strict bucket launch order and the ``num_items``
window; a :class:`~gradsync.engine.buckets.reduction.BucketReduction` says how a
ready bucket travels and what the end of backward leaves behind. ZeRO's answer
(arXiv 1910.02054, sections 5.1-5.2): a bucket is *reduced to shards*
(``transport/shard_comm.py``) and the end of backward divides this rank's slice
by the global item count. Stage 1 keeps the slice in the persistent bucket
buffer; stage 2 frees each bucket once its reduction has completed (waiting for
the oldest when more than ``MAX_INFLIGHT`` are pending), so only a few buckets
exist during backward and only the 2P/N gradient slice between backward and step.

A mixin of :class:`ZeroOptimizer`: it reads the
optimizer's ``_shards`` (:class:`BucketShard`),
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

from ...errors import UsageError
from ..buckets.reduction import BucketReduction
from ..replicated.data_parallel import DataParallel
from ..replicated.precision import (
    MixedPrecision,
    cast_buffers_,
    cast_inputs_hook,
    load_inner_state,
    master_dtype,
)
from ..sync.join import NoJoinHook, disabled_join_config
from ..sync.param_groups import assign_pieces, check_param_groups
from ..sync.replicas import verify_same_setup
from ..transport.shard_comm import ShardComm
from .clip import clip_grad_norm_
from .shard_memory import report_zero
from .shard_view import ShardView
from .shards import FlatShard

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta)


def check_elementwise(optimizer_class) -> None:
    """Reject optimizers whose update needs whole tensors (LBFGS, factored or matrix methods)."""
    if optimizer_class in ELEMENTWISE or getattr(optimizer_class, "gradsync_elementwise", False):
        return
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise UsageError(
        f"{name} cannot run on shards: a sharded optimizer holds pieces of tensors, so its "
        f"update must be elementwise. Allowed: {allowed}; a custom elementwise optimizer "
        "may declare `gradsync_elementwise = True`")


class BucketShard:
    """One bucket's flat parameter buffer, this rank's master slice and gradient slice."""

    def __init__(self, bucket, world: int, rank: int, originals: dict[int, torch.Tensor]):
        self.bucket = bucket
        self.layout = FlatShard(tuple(p.numel() for p in bucket.params), world)
        self.start, self.end = self.layout.shard_range(rank)
        p0 = bucket.params[0]
        self.flat = torch.zeros(self.layout.padded, dtype=p0.dtype, device=p0.device)
        full = torch.zeros(self.layout.padded, dtype=master_dtype(p0.dtype), device=p0.device)
        offset = 0
        with torch.no_grad():
            for p in bucket.params:
                n = p.numel()
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset:offset + n].view_as(p)
                # the master starts from the full-precision values, not their rounded copy
                full[offset:offset + n].copy_(originals[id(p)].reshape(-1))
                offset += n
        if master_dtype(p0.dtype) == p0.dtype:
            # fp32/fp64 parameters: the master *is* this rank's slice of the flat
            # parameter buffer (no second copy; torch's ZeroRedundancyOptimizer also
            # steps the parameters in place); the gather re-fills the other slices
            self.master = self.flat[self.start:self.end]
        else:
            self.master = full[self.start:self.end].clone()
        self.view = ShardView(self.master, self.layout, rank)
        self.grad: torch.Tensor | None = None  # this rank's slice of the synced gradient
        self.separate_master = master_dtype(p0.dtype) != p0.dtype
        self.has_grad = [False] * len(bucket.params)  # per parameter of the bucket
        self.aside: tuple[torch.Tensor, list[bool]] | None = None  # from before the window
        self.reduced: torch.Tensor | None = None  # during a sync: the reduced slice
        self.src: torch.Tensor | None = None  # during a sync: the buffer being reduced
        self.pending = None  # during a sync: the reduction in flight
        self.partial: torch.Tensor | None = None  # stage 2: reduced slice, not yet divided

    def load_master(self, values: dict[int, torch.Tensor]) -> None:
        """This rank's master slice from full-precision values (``id(param)`` -> tensor)
        of the bucket's parameters; a parameter without a value keeps its master."""
        offset = 0
        with torch.no_grad():
            for p in self.bucket.params:
                n = p.numel()
                lo, hi = max(offset, self.start), min(offset + n, self.end)
                v = values.get(id(p))
                if v is not None and lo < hi:
                    flat = v.detach().reshape(-1).to(self.master.dtype)
                    mine = self.master[lo - self.start:hi - self.start]
                    mine.copy_(flat[lo - offset:hi - offset])
                offset += n


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


class ZeroOptimizer(torch.optim.Optimizer, ZeroReduction):
    """ZeRO stage 1 or 2 around an elementwise torch optimizer.

    It is a ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` are the
    inner optimizer's (over this rank's parameter pieces), so LR schedulers work.

    Args:
        model: a :class:`gradsync.DataParallel` (its buckets become the shards).
        optimizer_class: e.g. ``torch.optim.AdamW``; see :data:`ELEMENTWISE`.
        stage: 1 (shard optimizer state) or 2 (also gradients).
        mixed_precision: a :class:`MixedPrecision`; the module's parameters are cast
            to ``param_dtype`` and the fp32 master lives in the shard. With a
            ``loss_scale`` (fp16's default) the model scales its loss and an overflowed
            step arrives with no gradient shards, so ``step()`` changes nothing.
        collectives: ``"auto"`` (per backend, measured; see ``shard_comm``; follows a
            DataParallel built with ``collectives="hierarchical"``), ``"native"``
            (reduce-scatter/all-gather), ``"all_reduce"``, ``"pairwise"``
            (point-to-point exchanges; what ``"auto"`` picks on gloo) or
            ``"hierarchical"`` (two-level, over the model's or torchrun's hosts).
        param_groups: groups by parameter name (``sync/param_groups.py``), e.g. no weight
            decay on biases; default: one group of every parameter.
        **optimizer_kwargs: passed to ``optimizer_class``.
    """

    owns_shards = True  # a rank whose inputs ran out must keep stepping (join.py)

    def __init__(self, model: DataParallel, optimizer_class, stage: int = 1,
                 mixed_precision: MixedPrecision | None = None, collectives: str = "auto",
                 param_groups=None, **optimizer_kwargs):
        if not isinstance(model, DataParallel):
            raise UsageError("ZeroOptimizer wraps a gradsync.DataParallel, got "
                             f"{type(model).__name__} (for stage 3 use "
                             "gradsync.FullyShardedDataParallel)")
        if isinstance(stage, bool) or stage not in (1, 2):
            hint = " (stage 3 is gradsync.FullyShardedDataParallel)" if stage == 3 else ""
            raise UsageError(f"ZeroOptimizer stage must be 1 or 2, got {stage!r}{hint}")
        check_elementwise(optimizer_class)
        self.model, self.stage = model, stage
        self.group, self.world, self.rank = model.group, model.world_size, model.rank
        self.mixed_precision = mixed_precision
        if collectives == "auto" and getattr(model, "collectives", "native") == "hierarchical":
            collectives = "hierarchical"  # follow the DataParallel it wraps
        self.comm = ShardComm.for_group(self.group, collectives, getattr(model, "topology", None))
        verify_same_setup({"stage": stage, "optimizer": getattr(optimizer_class, "__name__",
                                                                 repr(optimizer_class)),
                           "mixed_precision": mixed_precision, "collectives": collectives},
                          self.group, what="ZeroOptimizer")
        name = {id(p): n for n, p in model._optimizer_pieces()}
        group_of = (check_param_groups(param_groups, list(name.values()), name, "ZeroOptimizer")
                    if param_groups is not None else None)  # before anything changes
        originals = {id(p): p.detach().clone() for p in model.parameters()}
        if mixed_precision is not None:
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.data = p.data.to(mixed_precision.param_dtype)
            cast_buffers_(model.module, mixed_precision.param_dtype)
            if mixed_precision.cast_inputs:
                model.module.register_forward_pre_hook(
                    cast_inputs_hook(mixed_precision.param_dtype), with_kwargs=True)
        model.set_reduction(self)  # re-creates the (padded) bucket buffers
        if mixed_precision is not None and mixed_precision.loss_scale is not None:
            model.use_loss_scale(mixed_precision.loss_scale)  # fp16: sync/loss_scale.py
        self._shards = [BucketShard(b, self.world, self.rank, originals) for b in model.buckets]
        pieces = [t for s in self._shards for t in s.view.tensors]
        if group_of is not None:
            pieces = assign_pieces(param_groups, group_of, [
                (name[id(s.bucket.params[g.param])] if g else None, t) for s in self._shards
                for t, g in zip(s.view.tensors, s.view.segments or [None])])
        self.optimizer = optimizer_class(pieces, **optimizer_kwargs)
        super().__init__(pieces, dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups  # one truth: the inner optimizer's
        self.state = self.optimizer.state
        self._synced = False
        self._stepped = False  # step() ran on synced gradients not zeroed since
        self._warned_kept = False
        if any(sh.separate_master for sh in self._shards):  # weights loaded after building
            model.module.register_load_state_dict_pre_hook(self._masters_from_state_dict)

    def _masters_from_state_dict(self, _module, state_dict, prefix, *_rest) -> None:
        """With a separate master copy (bf16 parameters, fp32 masters), weights loaded into
        the model after the optimizer was built must reach the masters too, from the
        loaded full-precision values (not their rounded copy), or the next step would
        write the old masters back."""
        name_of = {id(p): n for n, p in self.model._optimizer_pieces()}
        for sh in self._shards:
            if sh.separate_master:
                sh.load_master({id(p): state_dict[prefix + name_of[id(p)]]
                                for p in sh.bucket.params
                                if prefix + name_of.get(id(p), "\0") in state_dict})

    def add_param_group(self, param_group) -> None:
        """torch's, while the optimizer is built; afterwards an error: the shards are cut
        when ZeroOptimizer is built, over the parameters trainable then (torch's
        ZeroRedundancyOptimizer re-partitions; here, rebuild, with ``param_groups=``)."""
        if getattr(self, "_synced", None) is None:  # inside torch.optim.Optimizer.__init__
            return super().add_param_group(param_group)
        raise UsageError("ZeroOptimizer.add_param_group: the shards are fixed when the "
                         "DataParallel and ZeroOptimizer are built; unfreeze the parameters "
                         "before building them (param_groups= gives them their own options)")

    # ------------------------------------------------------------------ optimizer API
    def grad_shards(self) -> list[torch.Tensor | None]:
        """This rank's slice of the global-mean gradient, one per bucket (None before a sync)."""
        if not self._synced:
            return [None] * len(self._shards)
        return [s.grad for s in self._shards]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every rank's gradient shards (``clip.py``)."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def step(self, closure=None):
        """Update this rank's parameter pieces, then all-gather the parameters."""
        if closure is not None:
            raise UsageError("ZeroOptimizer.step() takes no closure (closures need whole tensors)")
        synced = self._synced
        for s in self._shards:
            s.view.assign_grads(s.grad if synced else None, s.has_grad)
        self.optimizer.step()
        self._stepped = synced  # stepped on gradients that stay until zero_grad()
        self.gather_params()
        for s in self._shards:
            s.view.clear_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards and zero the buckets that are allocated.

        ``set_to_none=False`` (torch's, as DDP users call it): the synced shards stay,
        zeroed, with the parameters that had a gradient, so the next window adds to
        zeros (``set_aside``) and a parameter no rank uses in it keeps a zero gradient
        and is stepped (momentum, weight decay), as under DDP, where its ``.grad`` stays
        a zero tensor. Stage 2 does not re-allocate released buckets here; the next
        backward does.
        """
        self._stepped = False
        if not set_to_none and self._synced:
            for s in self._shards:
                if s.grad is not None:
                    s.grad.zero_()
                s.aside = None
                s.view.clear_grads()
                if s.bucket.buffer.untyped_storage().nbytes():
                    s.bucket.buffer.zero_()
            for p in self.model.parameters():
                p.grad = None
            return
        for s in self._shards:
            s.grad, s.aside = None, None
            s.view.clear_grads()
            if s.bucket.buffer.untyped_storage().nbytes():
                s.bucket.buffer.zero_()
        for p in self.model.parameters():
            p.grad = None
        self._synced = False

    # ------------------------------------------------------------ torch's Joinable
    _join_config = disabled_join_config()  # torch's Join sets it; the model notifies

    def join_hook(self, **_kwargs) -> NoJoinHook:
        """``torch.distributed.algorithms.join.Join([model, optimizer])``, as with torch's
        ZeroRedundancyOptimizer: this optimizer becomes the step a rank whose inputs ran
        out takes after each backward it shadows (the model's hook runs it)."""
        pending = self.model._torch_join
        if pending is None:
            raise UsageError("torch's Join: list the gradsync model before its "
                             "ZeroOptimizer, Join([model, optimizer])")
        if pending.optimizer is not None and pending.optimizer is not self:
            raise UsageError("torch's Join: two optimizers for one model "
                             "(Join([model, opt]) and optimizer=)")
        pending.optimizer = self
        return NoJoinHook()

    @property
    def join_device(self) -> torch.device:
        return self.model.join_device

    @property
    def join_process_group(self):
        return self.model.join_process_group

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's shard: master slices, inner optimizer state and the layout."""
        return {"stage": self.stage, "world": self.world, "rank": self.rank,
                "masters": [s.master.clone() for s in self._shards],
                "layouts": [s.layout.numels for s in self._shards],
                "names": [[self.model.trainable_names[i] for i in s.bucket.spec.params]
                          for s in self._shards],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict, gather: bool = True) -> None:
        """Load a shard saved by this rank with the same world size and layout.

        A different world size goes through ``gradsync.engine.sharded.checkpoint``.
        ``gather=False``: leave the full parameters as they are (no collective), for a
        caller that loads the matching full parameters itself -- a fault-tolerant
        heal, where torchft may heal some ranks of a group and not others.
        """
        if state.get("world") != self.world or state.get("rank") != self.rank:
            raise UsageError(f"state dict is rank {state.get('rank')} of {state.get('world')}, "
                             f"this is rank {self.rank} of {self.world}; load a sharded "
                             "checkpoint (re-shards on load) instead")
        if state["layouts"] != [s.layout.numels for s in self._shards]:
            raise UsageError("state dict layout differs from this model's buckets")
        with torch.no_grad():
            for s, m in zip(self._shards, state["masters"]):
                s.master.copy_(m)
        load_inner_state(self, self.optimizer, state["optimizer"])
        if gather:
            self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Re-build the full parameters from the master shards (after loading)."""
        pending = []
        for k, s in enumerate(self._shards):
            pending.append(self.comm.gather(s.flat, s.master.detach(), self.rank, self.group,
                                            tag=f"params{k}"))
        for p in pending:
            p.wait()

    @property
    def shards(self) -> list[BucketShard]:
        return self._shards

    def memory_report(self):
        return report_zero(self)

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, world={self.world}, "
                f"buckets={len(self._shards)}, optimizer={type(self.optimizer).__name__})")
