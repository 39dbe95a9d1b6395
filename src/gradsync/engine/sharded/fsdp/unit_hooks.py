"""What runs around each stage-3 unit's forward and backward, and its replay.

Around a unit (ZeRO stage 3, arXiv 1910.02054, section 5.3; FSDP's hooks):
before its forward the unit's flat buffer is all-gathered and the next units'
gathers are prefetched; after it the buffer is freed, unless the unit's backward
follows at once (the root and the last unit stay gathered); a hook on the unit's
outputs re-gathers it just before its backward; when autograd has accumulated
the unit's gradient, the buffer is freed and the gradient handed to the reducer.
A rank with no data replays the same gathers and (zero) reductions, so every
rank issues the same collectives in the same order.

A mixin of :class:`~gradsync.engine.sharded.fsdp.wrapper.FullyShardedDataParallel`:
it uses the wrapper's ``_gatherer``, ``_reducer``, ``_keep_for_backward`` and
``_root`` and the synchronised-backward core's ``_start_pass``, ``_join``,
``_syncing`` and ``_guard_nonfinite``.
"""

from __future__ import annotations

import torch

from ...sync.protocol import tensors_in


class UnitHooks:
    """Gather, free and reduce one unit at a time; replay the same for an empty rank."""

    def _make_pre(self, u):
        def pre(_module, _args):
            self._gatherer.gather(u, torch.is_grad_enabled())
            self._gatherer.prefetch_after(u, False, self.module)
        return pre

    def _make_post(self, u):
        return lambda _module, _args, out: self._after_forward(u, out)

    def _after_forward(self, u, out):
        if torch.is_grad_enabled():
            u.bw_gathered = False
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: self._pre_backward(u))
            if id(u) in self._keep_for_backward:
                u.kept = True
                return
        self._gatherer.free(u)

    def _pre_backward(self, u):
        self._start_pass(through_output=True)
        if not u.bw_gathered:
            u.bw_gathered = True
            self._gatherer.gather(u, True)
            self._gatherer.prefetch_after(u, True, self.module)

    def _make_grad_hook(self, u):
        def hook(full):
            self._join()
            g, full.grad = full.grad, None
            if self._guard_nonfinite and not bool(torch.isfinite(g).all()):
                g = torch.zeros_like(g)  # an empty rank's 0/0: contributes zero, not used
            else:
                u.used = [a or b for a, b in zip(u.used, u.joined)]
            self._gatherer.free(u)
            self._reducer.accept(u, g, self._syncing)
        return hook

    def _replay_forward(self) -> None:
        """The same gathers as this rank's last forward, keeping the same units."""
        self._gatherer.replay_forward(self._keep_for_backward)

    def _replay_backward(self) -> None:
        """The same gathers and reductions as a backward, with zero gradients."""
        def accept(u):
            u.joined = [True] * len(u.joined)
            self._reducer.accept(u, torch.zeros_like(u.full.data, dtype=u.full.dtype),
                                 self._syncing)
        order = self._reducer.order  # reverse registration order, the root last
        self._gatherer.replay_backward(order, accept, order[-1:] + order[:-1]
                                       if self._root is not None else order)  # root first
