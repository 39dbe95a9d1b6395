"""A rank without data runs the others' collectives with zeros: rule 5 and join().

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
from .join import Join


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
