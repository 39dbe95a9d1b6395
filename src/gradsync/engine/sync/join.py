"""Uneven inputs: ``with model.join():`` lets ranks run out of data at different steps.

torch DDP's answer to "the epoch ends on one rank one batch before another, and
the other hangs in its all-reduce" (arXiv 2006.15704 builds on it; torch's
``DistributedDataParallel.join`` and ``torch.distributed.algorithms.join``).
Every training iteration's collectives must be matched on every rank, so a rank
that left its loop keeps *shadowing* the others' until all have left:

* Each forward on a rank that still has data first all-reduces a small *signal*:
  whether the forward is grad-enabled, whether its backward will synchronise
  (``no_sync`` is decided at forward time), whether buffers are broadcast before
  it, and a one-hot of this rank (so every rank learns which ranks are active).
  A rank that has left runs the same all-reduce with zeros in a loop; when the
  sum says no rank is active any more, all have left and the context ends.
* For each signal a rank that has left replays that forward's collectives (the
  buffer broadcast, stage 3's gathers) and, for a grad-enabled forward, the
  backward's, with zero gradients and no items (rule 5 of ``core.py``).
  Its contribution is zero, so with ``backward(loss, num_items=n)`` the gradient
  is still the exact mean over every item the active ranks hold; with plain
  ``loss.backward()`` it is DDP's: the sum of the active ranks' means over the
  initial world size, or over the active ranks with
  ``divide_by_initial_world_size=False``.
* Buffers are broadcast from the highest active rank while some rank has left
  (its own buffers are stale), as DDP does.
* ``optimizer``: the step a rank that has left takes after each synchronised
  backward it shadows -- an optimizer (``step()`` then ``zero_grad()``) or a
  zero-argument function doing what the loop does after its backward (e.g.
  ``lambda: (opt.clip_grad_norm_(1.0), opt.step(), opt.zero_grad())``). With it
  every rank takes every step on the same global gradient, so replicas (and
  their optimizer states) stay identical throughout; ZeRO and stage 3 need it,
  because a rank that has left still owns a shard everybody else reads. Without
  it (DDP's form), a rank that has left does not step, and the context ends by
  broadcasting parameters and buffers from the last rank to leave, as DDP's
  post-hook does; gradients on a rank that has left are None then.

torch's generic context (``torch.distributed.algorithms.join.Join([model])``) is
the same as ``model.join(...)``: below.

What the shadow assumes, as DDP's does: every grad-enabled forward on an active
rank is followed by exactly one backward through the model (a validation loss
computed with gradients on and no backward would leave the ranks unmatched), the
loop steps after each synchronised backward (for ``optimizer``), and nothing
else in the loop issues collectives on the model's group. SyncBatchNorm cannot be
shadowed without an input (its statistics are collectives of the forward itself):
give such a rank an empty batch instead (``backward(loss, num_items=0)``).

A rank without data runs the others' collectives with zeros: rule 5 and join().

Every collective must be matched on every rank, so a rank with nothing to train
on still takes part. Two cases share one replay (``_replay_pass``: this rank's
share of a backward's collectives, zero gradients, nothing used, no items):

* rule 5 of ``core.py``: a rank with no data in this step calls
  ``backward(loss_or_None, num_items=0)`` (``_empty_pass``);
* uneven inputs: inside ``join()`` a rank whose loop ended shadows one iteration
  of the ranks still active per signal (``_shadow_iteration``; ``join.py`` says
  how and why).

torch's generic context works too: ``with torch.distributed.algorithms.join.Join([model]):``
(or ``Join([model, zero_optimizer])``, or ``Join([model], optimizer=opt)``) is the same
as ``model.join(...)``: the wrapper and :class:`~gradsync.ZeroOptimizer` are torch
``Joinable`` s (``join_hook``, ``join_device``, ``join_process_group``). torch's context
adds its own count all-reduce per forward (``notify_join_context``, as DDP's forward
calls it) and decides when every rank has left; each of its main-hook calls shadows
one iteration here, and its post-hook is the final sync below. The model must be the
first joinable (it calls the notification); ``throw_on_early_termination`` is torch's.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms import join as torch_join

from ...dist import comm_device
from ...errors import UsageError
from ..transport import comm
from .batchnorm import SyncBatchNorm
from .replicas import broadcast_module_state, broadcast_tensors

_GRAD, _SYNC, _BUFFERS = 0, 1, 2
_FLAGS = 3  # then one slot per rank: 1 where that rank is active


class Join:
    """The context :meth:`SyncedModule.join` returns; see the module docstring."""

    def __init__(self, model, divide_by_initial_world_size: bool = True, enable: bool = True,
                 throw_on_early_termination: bool = False, optimizer=None,
                 via_torch: bool = False):
        if not (optimizer is None or callable(optimizer) or _is_optimizer(optimizer)):
            raise UsageError("join(optimizer=...) takes an optimizer or a zero-argument function "
                             f"that steps it, got {type(optimizer).__name__}")
        if enable:
            sbn = next((type(m).__name__ for m in model.module.modules()
                        if isinstance(m, (torch.nn.SyncBatchNorm, SyncBatchNorm))), None)
            if sbn is not None:
                raise UsageError(
                    f"join() cannot shadow {sbn}: its statistics are collectives of the "
                    "forward itself, which a rank without an input cannot replay. Give a rank "
                    "that ran out an empty batch instead: model(x[:0]) and "
                    "model.backward(loss, num_items=0)")
        self.model = model
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        self.enable = bool(enable)
        self.throw_on_early_termination = bool(throw_on_early_termination)
        self.optimizer = optimizer
        self.world = model.world_size
        self.active = self.world  # ranks with data at the latest signal
        self.buffer_source = 0  # the rank buffers are broadcast from (the highest active)
        self.shadowed = 0  # iterations this rank shadowed after leaving its loop
        self.via_torch = via_torch  # made for torch's Join context (see TorchJoinHook)
        if enable and not via_torch:
            self._check_optimizer()  # torch's Join: when it opens (its ZeroOptimizer comes later)

    def _check_optimizer(self) -> None:
        if self.optimizer is None and self.model.owns_shards:
            raise UsageError(
                f"{type(self.model).__name__}.join() needs optimizer=: with sharded state a "
                "rank whose inputs ran out must keep stepping its shard (join(optimizer=opt), "
                "a function doing what the loop does after backward, or torch's "
                "Join([model, zero_optimizer]) / Join([model], optimizer=opt))")

    def _open(self) -> None:
        if self.model._join_state is not None:
            raise UsageError("join() is already open on this model")
        self._check_optimizer()
        self.model._join_state = self

    # ------------------------------------------------------------------ the context
    def __enter__(self):
        if self.enable:
            self._open()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enable:
            return False
        try:
            if exc_type is None:
                while self._shadow_once():
                    pass
                self._final_sync()
        finally:
            self.model._join_state = None
        return False

    # ------------------------------------------------------------------ active ranks
    def notify(self, grad_on: bool, sync: bool, buffers_due: bool) -> None:
        """Called by an active rank's forward before any collective of it."""
        signal = self._signal()
        signal[_GRAD], signal[_SYNC], signal[_BUFFERS] = grad_on, grad_on and sync, buffers_due
        signal[_FLAGS + self.model.rank] = 1
        self._exchange(signal)
        if self.throw_on_early_termination and self.active < self.world:
            raise RuntimeError(
                f"rank {self.model.rank}: {self.world - int(self.active)} rank(s) exhausted "
                "their inputs (join(throw_on_early_termination=True)); raising on every rank")

    def plain_divisor(self) -> float:
        """What plain ``loss.backward()`` gradients are divided by (DDP's join semantics)."""
        return float(self.world if self.divide_by_initial_world_size else self.active)

    # ------------------------------------------------------------------ ranks that left
    def _shadow_once(self) -> bool:
        """Shadow the active ranks' next forward (and backward, and step); False when
        no rank is active any more."""
        signal = self._signal()
        self._exchange(signal)
        if self.active == 0:
            return False
        if self.throw_on_early_termination:
            raise RuntimeError(f"rank {self.model.rank} exhausted its inputs "
                               "(join(throw_on_early_termination=True))")
        grad_on, sync = bool(signal[_GRAD] > 0), bool(signal[_SYNC] > 0)
        synced = self.model._shadow_iteration(grad_on, sync, bool(signal[_BUFFERS] > 0))
        if synced:
            self._step()
        self.shadowed += 1
        return True

    def _step(self) -> None:
        if self.optimizer is None:
            self.model._discard_gradients()
        elif _is_optimizer(self.optimizer):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer()

    def _final_sync(self) -> None:
        """DDP's post-hook: the last rank to leave is the authoritative copy (ties: the
        highest rank). Parameters only without ``optimizer`` (otherwise every rank took
        every step); buffers always, as they moved on the active ranks only."""
        model = self.model
        buffers = model._synced_buffers() if model.broadcast_buffers else []
        if self.world == 1 or (self.optimizer is not None and not buffers):
            return
        last = torch.tensor([model.rank if self.shadowed == 0 else -1], dtype=torch.float64,
                            device=comm_device(model.group))
        comm.all_reduce(last, model.group, op=torch.distributed.ReduceOp.MAX, tag="join")
        src = int(last[0])
        if self.optimizer is None:
            broadcast_module_state(model.module, model.group, src_rank=src)
        else:
            broadcast_tensors(buffers, model.group, src_rank=src, tag="buffers")

    # ------------------------------------------------------------------ the signal
    def _signal(self) -> torch.Tensor:
        return torch.zeros(_FLAGS + self.world, dtype=torch.float32,
                           device=comm_device(self.model.group))

    def _exchange(self, signal: torch.Tensor) -> None:
        comm.all_reduce(signal, self.model.group, tag="join")
        ranks = signal[_FLAGS:]
        self.active = float(ranks.sum())
        if self.active:
            self.buffer_source = int(torch.nonzero(ranks).max())


def _is_optimizer(obj) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "zero_grad")


class TorchJoinHook(torch_join.JoinHook):
    """torch's ``Join([model, ...])`` driving a :class:`Join`: each main hook shadows one
    iteration of the ranks still active (torch's count said there is one), the post-hook
    is the final sync."""

    def __init__(self, join: Join):
        self.join = join

    def main_hook(self) -> None:
        self.join.model._open_torch_join()
        if not self.join._shadow_once():
            raise RuntimeError("torch's Join counted an active rank, gradsync's signal none: "
                               "the model must be the first joinable of the Join")

    def post_hook(self, is_last_joiner: bool) -> None:
        model = self.join.model
        model._open_torch_join()  # a rank that never ran a forward in the context
        try:
            self.join._final_sync()
        finally:
            model._close_torch_join()


class NoJoinHook(torch_join.JoinHook):
    """A joinable whose shadow another joinable's hook performs (ZeroOptimizer's step
    runs inside its model's hook, after the backward it follows)."""


def disabled_join_config():
    """What a torch Joinable holds outside a torch ``Join`` context."""
    return torch_join._JoinConfig.construct_disabled_join_config()


class Shadow:
    """The replays of ``core.SyncedModule`` for a rank without data (module docstring)."""

    owns_shards = False  # state no other rank holds (ZeRO shards): join() needs optimizer=
    _join_config = disabled_join_config()  # torch's Join sets it (torch Joinable protocol)
    _torch_join: Join | None = None  # the Join a torch Join context made with join_hook

    # ------------------------------------------------------------ torch's Joinable
    def join_hook(self, divide_by_initial_world_size: bool = True, optimizer=None) -> TorchJoinHook:
        """torch's ``Join([model, ...], **kwargs)`` calls this with its kwargs: DDP's
        ``divide_by_initial_world_size``, and gradsync's ``optimizer`` (see :meth:`join`)."""
        self._torch_join = Join(self, divide_by_initial_world_size, True, False, optimizer,
                                via_torch=True)
        return TorchJoinHook(self._torch_join)

    @property
    def join_device(self) -> torch.device:
        return comm_device(self.group)

    @property
    def join_process_group(self):
        return self.group if self.group is not None else torch.distributed.group.WORLD

    def _open_torch_join(self) -> None:
        """Open the Join torch's context made, once, at the first forward or hook inside it."""
        pending = self._torch_join
        if pending is None or not self._join_config.enable:
            return
        if self._join_state is None:
            try:
                pending._open()
            except UsageError:
                self._close_torch_join()  # refused on every rank: the model stays usable
                raise
        elif self._join_state is not pending:
            raise UsageError("torch's Join([model]) inside model.join(): use one of the two")

    def _close_torch_join(self) -> None:
        self._join_state = self._torch_join = None
        self._join_config = disabled_join_config()

    def _notify_torch_join(self) -> None:
        """An active rank's forward inside torch's Join: torch's count first (as DDP's
        forward does), then gradsync's signal (``Join.notify``)."""
        self._open_torch_join()
        if self._join_state is not None and self._join_state.via_torch:
            if not self._join_config.is_first_joinable:
                raise UsageError("torch's Join: list the gradsync model first, "
                                 "Join([model, optimizer]), as with DDP")
            work = torch_join.Join.notify_join_context(self)
            if work is not None:
                work.wait()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False, optimizer=None) -> Join:
        """torch DDP's ``join()``: ranks may run out of inputs at different iterations.

        ``with model.join(optimizer=opt): for batch in my_shard: ...`` -- a rank whose
        loop ended shadows the others' collectives until every rank's has (see
        ``gradsync.engine.sync.join``); with ``num_items`` the gradient stays the exact mean
        over the items the active ranks hold. ``optimizer`` (required for ZeRO and
        stage 3): what a rank that left does after each synchronised backward it
        shadows, so that it keeps stepping with the others.
        """
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination,
                    optimizer)

    def _shadow_iteration(self, grad_on: bool, sync: bool, buffers_due: bool) -> bool:
        """One forward (and its backward) of the ranks that still have data, run by a
        rank that has none: the same collectives, zero gradients, no items. Returns
        whether it was a synchronised backward."""
        self._buffers_due = buffers_due
        self._sync_buffers()
        self._replay_forward()
        self._buffers_due = grad_on and sync
        if not grad_on:
            return False
        self._forward_sync, self._forward_ran = sync, False
        with self._window.uncounted_pass():
            self._replay_pass()
        return sync

    def _discard_gradients(self) -> None:
        """join() without an optimizer: a rank that left keeps no gradients."""
        for p in self.module.parameters():
            p.grad = None

    # ------------------------------------------------------------ a rank with no data
    def _empty_pass(self, loss, backward_kwargs) -> None:
        """Rule 5: this rank has no data.

        With a graph from a forward (the loss of an empty batch, NaN as a mean over
        nothing is) the backward runs through it with a zero output gradient: then
        collectives inside the graph (SyncBatchNorm's backward, stage 3's gathers)
        happen here as on every other rank, and what arrives is this rank's true
        share when its rows are coupled to others' (batch statistics over the
        global batch give rows without items a gradient). A non-finite arrival
        (0/0 of a mean over nothing) counts as zero and never touches what the
        window already holds. Without a graph, the forward's collectives (a buffer
        broadcast, stage 3's gathers) are replayed if no forward ran, then the
        backward's, with zeros.
        """
        if (loss is not None and self._forward_ran and isinstance(loss, torch.Tensor)
                and loss.requires_grad):
            self._guard_nonfinite = True
            self._hold_gradients()
            try:
                torch.autograd.backward(loss, torch.zeros_like(loss), **backward_kwargs)
            finally:
                self._guard_nonfinite = False
            return
        if not self._forward_ran:
            self._sync_buffers()
            self._forward_sync = self._require_sync
            self._buffers_due = self._require_sync
            self._replay_forward()
        self._replay_pass()

    def _replay_pass(self) -> None:
        """This rank's share of a backward's collectives, with zeros and nothing used."""
        self._start_pass(queue=False)
        self._empty = True
        try:
            self._join()
            self._replay_backward()
        finally:
            self._empty = False
        self._end_pass()
