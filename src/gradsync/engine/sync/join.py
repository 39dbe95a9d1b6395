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
the same as ``model.join(...)``: ``shadow.py``.

What the shadow assumes, as DDP's does: every grad-enabled forward on an active
rank is followed by exactly one backward through the model (a validation loss
computed with gradients on and no backward would leave the ranks unmatched), the
loop steps after each synchronised backward (for ``optimizer``), and nothing
else in the loop issues collectives on the model's group. SyncBatchNorm cannot be
shadowed without an input (its statistics are collectives of the forward itself):
give such a rank an empty batch instead (``backward(loss, num_items=0)``).
"""

from __future__ import annotations

import torch

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
