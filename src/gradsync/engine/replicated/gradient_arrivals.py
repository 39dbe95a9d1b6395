"""DataParallel's gradient hooks: each gradient into its bucket, a full bucket launched.

A post-accumulate-grad hook per parameter (DDP paper, arXiv 2006.15704, section
3.2) runs when autograd has finished that parameter's gradient in this
backward. On the hot path the gradient already lives in its bucket view (the
reduction re-points a ``.grad`` that ``zero_grad(set_to_none=True)`` left None at its
zeroed view when the window opens; else it is copied in once); when the bucket's
last gradient has landed, the layout launches every ready bucket in index order.
The unusual arrivals -- an undefined gradient, a rank without data replaying
zeros, an empty rank's graph whose arrivals count only when finite -- go through
``_receive_unusual``, so the hot path stays a few attribute checks.

A mixin of :class:`~gradsync.engine.replicated.data_parallel.DataParallel`: it
uses the wrapper's ``_layout``, ``_reduction``, ``_params``, ``_used``,
``_held``, ``_arrivals`` and the core's ``_joined``, ``_empty``, ``_syncing``,
``_window``.
"""

from __future__ import annotations

import torch


class GradientArrivals:
    """Where each parameter's gradient goes when autograd has accumulated it."""

    def _make_hook(self, i: int):
        where = self._layout.where

        def hook(param):
            if not self._joined:
                self._join()
            bucket, slot = where(i)
            grad = param.grad
            if i in self._reduction.repointed and not self._written[i]:
                grad = param.grad = None  # its zeroed view, and nothing accumulated into it
            if grad is not None and grad.layout != torch.strided:
                # a sparse gradient (nn.Embedding(sparse=True)) is summed dense: the same
                # values as torch DDP's sparse all-reduce; ``.grad`` comes back dense
                grad = param.grad = grad.to_dense()
            if grad is None or self._empty or self._held is not None:
                self._receive_unusual(i, param, bucket, slot)
            else:  # the hot path: a gradient autograd wrote (into the view, or fresh)
                bucket.zeroed = False
                if grad is not bucket.views[slot]:
                    self._reduction.ensure(bucket)
                    bucket.adopt(slot)
                    self.grad_copies += 1
                self._used[i] = True
            if not self._syncing or not self._arrivals.arrive(i):
                return
            bucket.pending -= 1
            if bucket.pending == 0:
                self._layout.launch_ready(self._reduction, self._window, self._used)
        return hook

    def _receive_unusual(self, i, param, bucket, slot) -> None:
        """An undefined gradient, a rank without data (replayed zeros, or its graph's
        arrivals: added only if finite), all joining with zeros where nothing counts."""
        if self._held is not None:
            fresh, param.grad = param.grad, self._held.pop(i, None)
            if fresh is not None and bool(torch.isfinite(fresh).all()):
                if param.grad is None:
                    param.grad = fresh
                else:
                    param.grad.add_(fresh)
        elif self._empty and not bucket.is_view(slot):
            param.grad = None
        if param.grad is None or self._empty:
            if not bucket.is_view(slot):
                self._reduction.ensure(bucket)
                bucket.views[slot].zero_()
                param.grad = bucket.views[slot]
        else:
            bucket.zeroed = False
            if not bucket.is_view(slot):
                self._reduction.ensure(bucket)
                bucket.adopt(slot)
            self._used[i] = True

    def _hold_gradients(self) -> None:
        self._held = {i: p.grad for i, p in enumerate(self._params) if p.grad is not None}
        for i in self._held:
            self._params[i].grad = None

    def _pass_over(self) -> None:
        for i, g in (self._held or {}).items():  # not reached by the empty rank's backward
            self._params[i].grad = g
        self._held = None

    def _replay_backward(self) -> None:
        """Every hook fires with zeros (marked not used): the same buckets, the same order."""
        torch.autograd.backward(self._params, [torch.zeros_like(p) for p in self._params])
