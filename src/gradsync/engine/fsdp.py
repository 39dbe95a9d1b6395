"""FullyShardedDataParallel: ZeRO stage 3 (arXiv 1910.02054, section 5.3).

Each wrapped unit's trainable parameters become one flat buffer padded to a
multiple of N; this rank keeps only its 1/N slice, in the master dtype, as the one
``nn.Parameter`` an optimizer sees (``model.parameters()`` are the shards). The
module's own parameters are replaced by views into a gathered buffer that exists
only while it is needed:

* before the unit's forward its buffer is all-gathered (the next units' gathers are
  prefetched, ``prefetch`` ahead, in registration order) and freed afterwards --
  except the root and the last unit, whose backward follows at once: they stay
  gathered into backward (a forward without a backward frees them at the next
  forward);
* a hook on the unit's outputs re-gathers it just before its backward (storage is
  re-filled in place, so the tensors autograd saved see the values again, as in
  FSDP1);
* when autograd has accumulated the unit's gradient, it is reduced to shards and
  the buffer is freed; the end of backward divides by the global item count.

Exactness follows DataParallel's rules: ``backward(loss, num_items=n)`` scales to a
local sum, a 24-byte header carries the window's item count, ``no_sync`` issues no
gradient collective (parameters must still be gathered, they are sharded) and
accumulates unsharded gradients locally. Gathers and gradient reductions run on
two process groups, so each has one deterministic order on every rank (gathers in
forward then backward unit order, reductions strictly in reverse registration
order, root last) whatever order autograd happens to fire hooks in.

A parameter shared by two units (tied weights) belongs to the root unit, which is
gathered for the whole forward. A rank with ``num_items=0`` replays the same
collective sequence, assuming units run in registration order.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from . import comm
from .data_parallel import _as_count, _tensors_in
from .fsdp_units import FlatUnit as _Unit
from .fsdp_units import build_units, slot_names
from .item_window import HEADER_SLOTS, ItemWindow
from .precision import MixedPrecision, cast_inputs_hook
from .replicas import broadcast_module_state, comm_device, verify_same_structure
from .shard_comm import ShardComm


class FullyShardedDataParallel(nn.Module):
    """Shard parameters, gradients and optimizer state of ``module`` over ``group``.

    Args:
        wrap: a set/tuple of module classes, or a predicate ``f(module) -> bool``,
            choosing the units (e.g. ``{Block}``); the rest belongs to the root unit.
        mixed_precision: a :class:`MixedPrecision`; gathered parameters and
            gradients are in ``param_dtype``, shards stay fp32.
        prefetch: how many units ahead to start gathering (0: none).
        collectives: ``"auto"`` | ``"native"`` | ``"all_reduce"`` | ``"pairwise"``
            (see ``shard_comm``; ``"auto"`` is ``"pairwise"`` on gloo, ``"native"`` on NCCL).
    """

    MAX_INFLIGHT = 4  # gradient reductions in flight before waiting for the oldest

    def __init__(self, module: nn.Module, wrap=None, mixed_precision: MixedPrecision | None = None,
                 prefetch: int = 1, group=None, collectives: str = "auto"):
        super().__init__()
        if not dist.is_initialized():
            raise UsageError("FullyShardedDataParallel needs an initialised process group")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise UsageError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        self.module, self.group, self.mixed_precision = module, group, mixed_precision
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.prefetch = prefetch
        self.comm = ShardComm.for_group(group, collectives)
        self._grad_group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD))
        self._dev = comm_device(group)
        verify_same_structure(module, group, what="FullyShardedDataParallel")
        broadcast_module_state(module, group)
        self._keys = list(module.state_dict().keys())
        self._units = build_units(module, wrap, self.world, self.rank,
                                  mixed_precision.param_dtype if mixed_precision else None)
        self.shards = nn.ParameterList([u.shard for u in self._units])
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
        self._reduce_order = rest[::-1] + root
        # kept gathered from forward into backward (FSDP2 keeps the root; DeepSpeed's
        # reuse distance keeps what is needed again at once): the root, and the last
        # unit, whose backward comes first -- a free and a gather saved each
        self._keep_for_backward = set(map(id, root + rest[-1:]))
        self._require_sync, self._forward_sync = True, None
        self._in_backward = self._syncing = False
        self._window = ItemWindow(self.world, self.rank)
        self._header = None
        self._next_reduce = 0
        self._inflight: list[_Unit] = []
        self._div: float | None = None

    # ------------------------------------------------------------------ gather / free
    def _launch_gather(self, u: _Unit) -> None:
        if u.gather_pending is not None or u.full.untyped_storage().nbytes():
            return
        full = u.full.data
        full.untyped_storage().resize_(full.numel() * full.element_size())
        u.gather_pending = self.comm.gather(full, u.shard.detach(), self.rank, self.group,
                                            tag=f"unit{u.index}")

    def _gather(self, u: _Unit, grad: bool) -> None:
        self._launch_gather(u)
        if u.gather_pending is not None:
            u.gather_pending.wait()
            u.gather_pending = None
        views = u.param_views(grad)
        for mod, attr, k in u.slots:
            setattr(mod, attr, views[k])

    def _free(self, u: _Unit) -> None:
        u.kept = False
        u.full.untyped_storage().resize_(0)

    def _prefetch_after(self, u: _Unit, backward: bool) -> None:
        seq = self._units[::-1] if backward else self._units
        pos = seq.index(u)
        for nxt in seq[pos + 1:pos + 1 + self.prefetch]:
            if nxt.module is not self.module:
                self._launch_gather(nxt)

    # ------------------------------------------------------------------ hooks
    def _make_pre(self, u):
        def pre(_module, _args):
            self._gather(u, torch.is_grad_enabled())
            self._prefetch_after(u, backward=False)
        return pre

    def _make_post(self, u):
        def post(_module, _args, out):
            self._after_forward(u, out)
        return post

    def _after_forward(self, u, out):
        if torch.is_grad_enabled():
            u.bw_gathered = False
            for t in _tensors_in(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: self._pre_backward(u))
            if id(u) in self._keep_for_backward:
                u.kept = True
                return
        self._free(u)

    def _release_kept(self):
        """Free what an earlier forward kept for a backward that never came."""
        for u in self._units:
            if u.kept:
                self._free(u)  # clears u.kept

    def _pre_backward(self, u):
        self._start_pass()
        if not u.bw_gathered:
            u.bw_gathered = True
            self._gather(u, True)
            self._prefetch_after(u, backward=True)

    def _make_grad_hook(self, u):
        def hook(full):
            g = full.grad
            full.grad = None
            self._free(u)
            self._accept(u, g)
        return hook

    def _accept(self, u, g):
        u.grad_seen = True  # contributed to this pass (a real gradient or zeros)
        rd = self.mixed_precision.reduce_dtype if self.mixed_precision else g.dtype
        g = g.to(rd)
        if u.acc is not None:
            g = g + u.acc
        if not self._syncing:
            u.acc = g
            return
        u.acc, u.ready = None, g
        self._launch_reduces()

    def _launch_reduces(self):
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].ready is not None:
            u = order[self._next_reduce]
            pending, part = self.comm.reduce(u.ready, self.rank, self.world, self._grad_group,
                                             tag=f"grad{u.index}")
            u.reduced, u.ready = (pending, part, u.ready), None
            self._next_reduce += 1
            self._inflight.append(u)
            while self._inflight and (len(self._inflight) > self.MAX_INFLIGHT
                                      or self._inflight[0].reduced[0].done()):
                self._finalize(self._inflight.pop(0))

    # ------------------------------------------------------------------ passes
    def forward(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        if not self._in_backward:
            self._release_kept()
        if grad and not self._in_backward:
            self._forward_sync = self._require_sync
        root = self._units[0] if self._units and self._units[0].module is self.module else None
        if root is not None:
            self._gather(root, grad)
            self._prefetch_after(root, backward=False)
        out = self.module(*args, **kwargs)
        if grad:
            for t in _tensors_in(out):
                if t.requires_grad:
                    t.register_hook(lambda g: self._start_pass())
        if root is not None:
            self._after_forward(root, out)
        return out

    def backward(self, loss=None, num_items=None, **kwargs) -> None:
        """As :meth:`gradsync.DataParallel.backward` (exact global mean with ``num_items``)."""
        if num_items is None:
            if loss is None:
                raise UsageError("backward() needs a loss (or num_items=0)")
            loss.backward(**kwargs)
            return
        n = _as_count(num_items)
        if n and loss is None:
            raise UsageError(f"backward() got num_items={num_items} but no loss")
        with self._window.item_pass(n):
            if n == 0:
                self._empty_pass()
            else:
                (loss * n).backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally; no gradient collective until the synced step."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def _empty_pass(self):
        """A rank without data issues the same collectives with zero gradients."""
        self._forward_sync = self._require_sync
        self._release_kept()
        for u in self._units:  # the same gathers as a forward, keeping the same units
            self._gather(u, False)
            if id(u) not in self._keep_for_backward:
                self._free(u)
        self._start_pass(queue=False)
        root = [u for u in self._units if u.module is self.module]
        rest = [u for u in self._units if u.module is not self.module]
        for u in root + rest[::-1]:
            self._gather(u, False)
            self._free(u)
            self._accept(u, torch.zeros_like(u.full.data, dtype=u.full.dtype))
        self._end_of_backward()

    def _start_pass(self, queue: bool = True):
        if self._in_backward:
            return
        self._in_backward = True
        if queue:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._window.pass_started()
        sync = self._forward_sync if self._forward_sync is not None else self._require_sync
        self._syncing = sync
        if self._units and self._units[0].module is self.module:
            # the root is re-gathered first, whichever output hook autograd fires first,
            # so the gather sequence is the same on every rank (and in _empty_pass)
            self._launch_gather(self._units[0])
        if sync:
            self._next_reduce, self._inflight, self._div = 0, [], None
            for u in self._units:
                u.grad_seen = False
            self._header = torch.zeros(HEADER_SLOTS, dtype=torch.float64, device=self._dev)
            self._window.write(self._header)
            self._header_pending = comm.all_reduce(self._header, self._grad_group,
                                                   async_op=True, tag="header")

    def _end_of_backward(self):
        try:
            if self._syncing:
                self._finish_sync()
        finally:
            self._in_backward = self._syncing = False
            self._forward_sync = None
            self._window.pass_ended()
            for u in self._units:
                u.bw_gathered = False

    def _finish_sync(self):
        for u in self._reduce_order:  # unused in this backward: a zero contribution
            if not u.grad_seen:
                self._free(u)
                self._accept(u, torch.zeros(u.layout.padded, dtype=u.full.dtype))
        while self._inflight:
            self._finalize(self._inflight.pop(0))

    def _divisor(self) -> float:
        """The global item count (waits for the header, launched as backward started)."""
        if self._div is None:
            self._header_pending.wait()
            self._div = self._window.close(self._header)
        return self._div

    def _finalize(self, u: _Unit) -> None:
        """Wait for ``u``'s reduction, keep the divided slice, drop the unsharded gradient.

        Done when the reduction has completed (checked without blocking as later
        units launch) or when more than ``MAX_INFLIGHT`` are pending, so few unsharded
        gradients are alive at once (ZeRO-3's gradient memory) and backward rarely waits.
        """
        pending, part, _src = u.reduced
        pending.wait()
        div = self._divisor()
        if u.shard.grad is None:  # one pass: divide into a fresh tensor of the shard's dtype
            u.shard.grad = torch.empty_like(u.shard)
            torch.div(part, div, out=u.shard.grad)
        else:
            u.shard.grad.add_(part.div_(div))
        u.reduced = None

    # ------------------------------------------------------------------ state
    def grad_shards(self):
        return [u.shard.grad for u in self._units]

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The consolidated state dict with the original names (every rank gets it)."""
        out = dict(self.module.state_dict())
        for u in self._units:
            full = torch.empty(u.layout.padded, dtype=u.shard.dtype)
            self.comm.gather(full, u.shard.detach(), self.rank, self.group,
                             tag=f"state{u.index}").wait()
            pieces = full[:u.layout.numel].split(list(u.layout.numels))
            names = self._slot_names(u)
            for (_mod, _attr, k), name in zip(u.slots, names):
                out[name] = pieces[k].view(u.shapes[k]).clone()
        return {k: out[k] for k in self._keys if k in out}

    def _slot_names(self, u):
        return slot_names(self.module, u)

    @property
    def units(self):
        return self._units

    def memory_report(self, optimizer=None):
        from .memory import report_fsdp
        return report_fsdp(self, optimizer)
