"""Eager updates for streaming DiLoCo: an outer step now, corrected when the sum arrives.

Streaming DiLoCo overlaps a fragment's all-reduce with the next tau inner steps and
applies the global copy only when it arrives (``streaming.py``), so for tau steps a
worker trains on a fragment that has not had its outer step. Eager updates (Kale,
Douillard, Donchev, arXiv 2502.12996) take the outer step at once on a stand-in for
the average the all-reduce will bring: this worker's own pseudo-gradient of now plus
the other workers' of the previous round, known from the last completed sum of this
fragment (the sum minus this worker's own previous part). gradsync keeps its item
weighting: the stand-in is ``(own + S_prev - own_prev) / (n + N_prev - n_prev)`` with
the item-weighted parts ``own``, ``S_prev`` and counts ``n``, ``N_prev``; the first
round, with no previous sum, uses the worker's own alone.

At send time the outer step is taken on the stand-in and merged with ``alpha`` as
streaming merges a result; when the true sum arrives the global copy and the outer
optimizer's state for the fragment are put back as they were before the stand-in
step, the true outer step is taken, and the local fragment is shifted by ``(1 -
alpha) x (true global - stand-in global)``: the tau inner steps taken since are kept,
and the replica ends where the plain merge of the true result would have put it had it
been applied at send time. So every worker agrees again once a result lands, and with
one worker (no others: the stand-in *is* the average) eager with delay tau is
streaming DiLoCo with tau = 0, bit for bit (tested).

How the paper's own weighting of the two parts reads in detail was not checked
against its text here; the rule above is the issue's statement of it.
"""

from __future__ import annotations

import torch


def snapshot(frag, outer: torch.optim.Optimizer):
    """The fragment's global copy, its outer optimizer state and outer step count."""
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in outer.state[a].items()}
              if a in outer.state else None for a in frag.anchors]
    return [a.detach().clone() for a in frag.anchors], states, frag.outer_steps


def restore(frag, outer: torch.optim.Optimizer, saved) -> None:
    anchors, states, steps = saved
    with torch.no_grad():
        for a, v in zip(frag.anchors, anchors):
            a.copy_(v)
    for a, st in zip(frag.anchors, states):
        if st is None:
            outer.state.pop(a, None)
        else:
            outer.state[a] = st
    frag.outer_steps = steps


class EagerUpdates:
    """Streaming DiLoCo's eager path (a mixin: it uses the fragments, ``_apply``, ``alpha``)."""

    def _eager_launch(self, frag, own: torch.Tensor, items: float, job) -> None:
        """The stand-in outer step at send time, merged with alpha; remembered on ``job``."""
        prev = self._eager_prev[frag.index]
        est, total = own, items
        if prev is not None:
            summed, summed_items, own_prev, items_prev = prev
            est, total = own + (summed - own_prev), items + (summed_items - items_prev)
        saved = snapshot(frag, self.outer_optimizer)
        self._apply(frag, est, total, self.alpha)
        job.eager = {"saved": saved, "stand_in": [a.detach().clone() for a in frag.anchors],
                     "own": own, "items": items}

    def _eager_finish(self, frag, job, flat: torch.Tensor, total: float) -> None:
        """The true outer step from where the stand-in started; the replica shifted by what
        the stand-in got wrong."""
        eager = job.eager
        restore(frag, self.outer_optimizer, eager["saved"])
        self._apply(frag, flat, total, self.alpha, merge=False)
        with torch.no_grad():
            for p, a, s in zip(frag.params, frag.anchors, eager["stand_in"]):
                p.add_((a - s).to(p.dtype), alpha=1 - self.alpha)
        self._eager_prev[frag.index] = (flat, total, eager["own"], eager["items"])
