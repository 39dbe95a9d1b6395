"""FullyShardedDataParallel: ZeRO stage 3 (arXiv 1910.02054, section 5.3).

Each wrapped unit's trainable parameters become one flat buffer padded to a
multiple of N; this rank keeps only its 1/N slice, in the master dtype, which the
optimizer steps piece by piece (``model.parameters()`` are one ``nn.Parameter``
per parameter piece, so a parameter no rank used has no gradient and is not
stepped, as in torch DDP). The module's own parameters are replaced by views into
a gathered buffer that exists only while it is needed:

* before the unit's forward its buffer is all-gathered (the next units' gathers are
  prefetched, ``prefetch`` ahead, in registration order) and freed afterwards --
  except the root and the last unit, whose backward follows at once: they stay
  gathered into backward (the next forward frees what a backward did not);
* a hook on the unit's outputs re-gathers it just before its backward (storage is
  re-filled in place, so the tensors autograd saved see the values again, as in
  FSDP1);
* when autograd has accumulated the unit's gradient, it is reduced to shards and
  the buffer is freed; the end of backward divides by the global item count.

Passes, windows, ``no_sync``, ``num_items``, buffers (broadcast from rank 0 exactly
when torch DDP would, like DataParallel) and the DDP-compatibility rules are the
synchronised-backward core's (``sync/core.py``). Under ``no_sync`` no gradient
collective runs (parameters must still be gathered, they are sharded) and
unsharded gradients accumulate locally. Gathers and gradient reductions run on
two process groups, so each has one deterministic order on every rank (gathers in
forward then backward unit order, reductions strictly in reverse registration
order, root last: ``reduce.py``) whatever order autograd happens to fire hooks in.

A parameter shared by two units (tied weights) belongs to the root unit, which is
gathered for the whole forward. Every rank must run the same units in each forward
(a rank with ``num_items=0`` and no forward replays its own last forward's gathers):
each gather is a collective, so a branch that skips a unit on some ranks only leaves
the ranks' collectives unmatched, a hang or a backend abort, as under torch's FSDP.
Such a branch belongs inside one unit (or leave that module unwrapped).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ....errors import UsageError
from ...replicated.precision import (
    MixedPrecision,
    cast_buffers_,
    cast_frozen_params_,
    cast_inputs_hook,
)
from ...sync.core import SyncedModule
from ...sync.protocol import Collected
from ...sync.replicas import (
    broadcast_module_state,
    comm_device,
    verify_same_setup,
    verify_same_structure,
    without_ddp_prefix,
)
from ...transport.algorithms import HostTopology
from ...transport.algorithms.topology import host_topology
from ...transport.comm_thread import private_group
from ...transport.shard_comm import ShardComm
from ..clip import clip_grad_norm_
from ..shard_memory import report_fsdp
from .gather import UnitGatherer
from .reduce import UnitReducer
from .state import full_state_dict, load_full_state_dict
from .unit_hooks import UnitHooks
from .units import build_units, first_names


class FullyShardedDataParallel(UnitHooks, SyncedModule):
    """Shard parameters, gradients and optimizer state of ``module`` over ``group``.

    Args:
        wrap: a set/tuple of module classes, or a predicate ``f(module) -> bool``,
            choosing the units (e.g. ``{Block}``); the rest belongs to the root unit.
        mixed_precision: a :class:`MixedPrecision`; gathered parameters and
            gradients are in ``param_dtype``, shards stay fp32. With a ``loss_scale``
            (fp16's default) the loss is scaled in ``backward(loss, num_items=n)`` and
            divided out into the fp32 gradient shards; an overflowed step leaves every
            piece's ``.grad`` None, so any optimizer's ``step()`` changes nothing.
        prefetch: how many units ahead to start gathering (0: none).
        collectives: ``"auto"`` | ``"native"`` | ``"all_reduce"`` | ``"pairwise"``
            (see ``shard_comm``; ``"auto"`` is ``"pairwise"`` on gloo, ``"native"`` on NCCL).
        find_unused_parameters, broadcast_buffers: as :class:`gradsync.DataParallel`.
        hybrid: ``True`` or a :class:`~gradsync.engine.transport.algorithms.HostTopology`: shard
            inside a host and replicate across hosts (HSDP): gathers and gradient
            reduce-scatters stay on the fast intra-host links, and only each rank's
            gradient shard is all-reduced across hosts (default group only).
    """
    owns_shards = True  # join() needs the optimizer of a rank whose inputs ran out

    def __init__(self, module: nn.Module, wrap=None, mixed_precision: MixedPrecision | None = None,
                 prefetch: int = 1, group=None, collectives: str = "auto",
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 hybrid=False):
        super().__init__(module, group, find_unused_parameters, broadcast_buffers,
                         "FullyShardedDataParallel")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise UsageError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        if hybrid and group is not None:
            raise UsageError("hybrid sharding (HSDP) shards over the default group's hosts")
        self.mixed_precision, self.prefetch = mixed_precision, prefetch
        self.topology = (hybrid if isinstance(hybrid, HostTopology)
                         else host_topology(None) if hybrid else None)
        shard_group = self.topology.intra_group if self.topology else group
        self.shard_group = shard_group
        self.world, self.rank = dist.get_world_size(shard_group), dist.get_rank(shard_group)
        self.writes_shards = self.topology is None or self.topology.host == 0  # checkpoints
        self.comm = ShardComm.for_group(shard_group, collectives)
        grad_group = private_group(shard_group)
        self._sum_group = private_group(None) if self.topology else grad_group
        self._dev = comm_device(group)
        verify_same_structure(module, group, what="FullyShardedDataParallel")
        broadcast_module_state(module, group)
        self.original_keys = list(module.state_dict().keys())
        names = {id(m): n for n, m in module.named_modules()}
        if mixed_precision is not None:
            cast_buffers_(module, mixed_precision.param_dtype)
            cast_frozen_params_(module, mixed_precision.param_dtype)
        self._units = build_units(module, wrap, self.world, self.rank,
                                  mixed_precision.param_dtype if mixed_precision else None,
                                  self._dev)
        verify_same_setup({"units (module, parameter sizes)": [
            (names[id(u.module)], u.layout.numels) for u in self._units],
            "mixed_precision": mixed_precision, "hybrid": self.topology is not None},
            group, what="FullyShardedDataParallel")
        self.shards = nn.ParameterList([t for u in self._units for t in u.view.tensors])
        self._slots = [(u, k) for u in self._units for k in range(len(u.shapes))]
        self._names = [n for u in self._units for n in first_names(module, u)]
        self._hooks = []
        for u in self._units:
            if u.module is not module:
                self._hooks.append(u.module.register_forward_pre_hook(self._make_pre(u)))
                self._hooks.append(u.module.register_forward_hook(self._make_post(u)))
            self._hooks.append(u.full.register_post_accumulate_grad_hook(self._make_grad_hook(u)))
        if mixed_precision is not None and mixed_precision.cast_inputs:
            self._hooks.append(module.register_forward_pre_hook(
                cast_inputs_hook(mixed_precision.param_dtype), with_kwargs=True))
        root = [u for u in self._units if u.module is module]
        rest = [u for u in self._units if u.module is not module]
        self._root = root[0] if root else None
        self._gatherer = UnitGatherer(self._units, self.comm, shard_group, self.rank, prefetch)
        self._reducer = UnitReducer(rest[::-1] + root, self.comm, self.rank, self.world,
                                    grad_group, self.topology.inter_group if self.topology
                                    else None,
                                    mixed_precision.reduce_dtype if mixed_precision else None)
        # kept gathered into backward (FSDP2 keeps the root; DeepSpeed's reuse distance,
        # what is needed again at once): the root and the last unit, whose backward is first
        self._keep_for_backward = set(map(id, root + rest[-1:]))
        if mixed_precision is not None and mixed_precision.loss_scale is not None:
            self.use_loss_scale(mixed_precision.loss_scale)  # fp16: sync/loss_scale.py

    # ------------------------------------------------------------------ core hooks
    def _run_forward(self, args, kwargs):
        grad = torch.is_grad_enabled()
        if not self._in_pass:
            self._gatherer.release_all()
            if grad:  # recorded, for a rank with no data to replay (gather.py)
                self._gatherer.phase("forward")
        with contextlib.nullcontext() if grad else self._gatherer.paused():
            if self._root is not None:
                self._gatherer.gather(self._root, grad)
                self._gatherer.prefetch_after(self._root, False, self.module)
            out = self.module(*args, **kwargs)
            if self._root is not None:
                self._after_forward(self._root, out)
        return out

    def _param_names(self) -> list[str]:
        return self._names

    def _optimizer_pieces(self):
        name = {(id(u), k): n for (u, k), n in zip(self._slots, self._names)}
        return [(name[id(u), s.param] if u.view.segments else None, t)
                for u in self._units for t, s in zip(u.view.tensors, u.view.segments or [None])]

    def _trainable(self) -> list[bool]:
        return [True] * len(self._slots)

    def _pass_started(self) -> None:
        self._gatherer.phase("backward")
        if self._root is not None:
            # the root is re-gathered first, whichever output hook autograd fires first,
            # so the gather sequence is the same on every rank (and in _replay_empty)
            self._gatherer.launch(self._root)

    def _pass_over(self) -> None:
        for u in self._units:
            u.bw_gathered = False
            u.joined = [False] * len(u.joined)

    def _set_aside(self) -> None:
        """Rule 2, piece by piece: what each optimizer piece's ``.grad`` holds now (a
        piece the optimizer zeroed holds None and contributes nothing, while a piece no
        optimizer owns keeps accumulating, as a torch parameter outside the optimizer)."""
        for u in self._units:
            u.aside = None
            if u.grad is not None:
                kept, has = u.grad, [False] * len(u.shapes)
                for t, s in zip(u.view.tensors, u.view.segments):
                    piece = kept[s.shard_offset:s.shard_offset + s.numel]
                    if t.grad is None:
                        piece.zero_()
                    else:
                        has[s.param] = True
                        if t.grad.data_ptr() != piece.data_ptr():  # replaced, not a view
                            piece.copy_(t.grad)
                if any(has):
                    u.aside = (kept, has)
            u.grad = None

    def _take_back(self) -> None:
        for u in self._units:
            if u.aside is not None:
                u.grad, u.aside = u.aside[0], None

    def _sync_open(self) -> None:
        self._reducer.start()
        self._launch_header(self._sum_group)

    def _sync_collect(self) -> Collected:
        for u in self._reducer.unseen():  # not reached in this backward: a zero contribution
            self._gatherer.free(u)
            self._reducer.accept(u, torch.zeros(u.layout.padded, dtype=u.full.dtype,
                                                    device=u.full.device),
                                 self._syncing)
        self._reducer.finish()
        missing = [i for i, (u, k) in enumerate(self._slots) if not u.joined[k]]
        used = (self._sum_used([u.used[k] for u, k in self._slots], self._sum_group)
                if self.find_unused_parameters else None)
        return Collected(self._summed_header(), used, missing)

    def _sync_complete(self, divisor: float, used: list[bool]) -> None:
        flags = iter(used)
        for u in self._units:
            grad = u.part.div_(divisor)
            u.part = None
            if grad.dtype != u.shard.dtype:
                grad = grad.to(u.shard.dtype)
            has = [next(flags) for _ in u.shapes]
            if u.aside is not None:
                grad.add_(u.aside[0])
                has = [a or b for a, b in zip(has, u.aside[1])]
            u.grad, u.has_grad, u.aside = grad, has, None
            u.used = [False] * len(has)
            u.view.assign_grads(grad, has)

    def _synced_grads(self):
        return [u.grad for u in self._units if u.grad is not None], self._sum_group, True

    def _drop_grads(self) -> None:
        for u in self._units:
            u.grad, u.aside = None, None
            u.has_grad = [False] * len(u.has_grad)
            u.view.clear_grads()

    def _sync_reset(self) -> None:
        for u in self._units:
            u.part = u.reduced = u.ready = None
            u.used = [False] * len(u.used)

    # ------------------------------------------------------------------ state
    def grad_shards(self):
        """This rank's slice of each unit's synchronised gradient (None before a sync)."""
        return [u.grad for u in self._units]

    def grad_used(self) -> list[bool]:
        """Whether each parameter (unit by unit) has a synchronised gradient."""
        return [h for u in self._units for h in u.has_grad]

    def set_grad_used(self, used: list[bool]) -> None:
        """``ZeroReduction.set_grad_used``: the pieces of the marked parameters get their
        (zero) gradient, so the optimizer steps them as the other groups do."""
        flags = iter(used)
        for u in self._units:
            u.has_grad = [next(flags) for _ in u.has_grad]
            u.view.assign_grads(u.grad, u.has_grad)

    def full_state_dict(self) -> dict:
        """The consolidated state dict, original names (a collective: ``state.py``)."""
        return full_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A consolidated dict (original names) is sliced into this rank's shards with no
        collective (``state.py``), also one torch DDP saved (``module.`` keys); a
        dict of this wrapper's own keys is nn.Module's."""
        state_dict = without_ddp_prefix(state_dict, self.original_keys)
        if not set(state_dict) & set(self.original_keys):
            return super().load_state_dict(state_dict, strict, assign)
        return load_full_state_dict(self, state_dict, strict)

    def release_gathered(self) -> None:
        self._gatherer.release_all()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch FSDP's method: clip by the norm over every rank's shards (``sharded/clip.py``;
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would see one shard)."""
        return clip_grad_norm_(self, max_norm, norm_type)

    @property
    def units(self):
        return self._units

    def memory_report(self, optimizer=None):
        return report_fsdp(self, optimizer)

