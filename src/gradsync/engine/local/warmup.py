"""Synchronous warm-up before local steps: post-local SGD (Lin et al., arXiv 1808.07217).

The first W inner steps of a DiLoCo run are exact synchronous data parallelism
(``schedule.py`` says why): the caller's backward, once its accumulation window
closes, asks :attr:`warming_up` and if so hands the gradient to
:meth:`average_gradients`, which sums every worker's gradient with its items and
divides by the global count -- gradsync's exact weighting, as ``--sync exact``
computes it, not DDP's average of means. Every replica then takes the same inner
step, so they stay bitwise identical (tested). After step W the global copy is
reset to the parameters and DiLoCo's local steps begin.

The hook sits between backward and the optimizer step because that is where
synchronous data parallelism communicates; ``strategy/inexact.py``'s
``LocalModel.backward`` calls it, and so can a hand-written loop. torch's
``PostLocalSGDOptimizer`` does the same with a DDP comm hook that all-reduces
until ``start_localSGD_iter``.
"""

from __future__ import annotations

import torch

from .exchange import mean_gradients


class SynchronousWarmUp:
    """DiLoCo's warm-up steps (a mixin: it uses DiLoCo's schedule, fragments, group and
    byte counters)."""

    @property
    def warming_up(self) -> bool:
        """Whether the inner step being taken is synchronous (``warmup_steps``): its gradient
        must go through :meth:`average_gradients` before the inner optimizer steps."""
        return self.schedule.warming_up(self._steps)

    def average_gradients(self, weight: float = 1.0, items: float = 1.0) -> None:
        """A warm-up step's gradient: ``sum over workers (weight * .grad) / sum of items``
        (``exchange.mean_gradients``), identical on every rank. Every rank calls it."""
        params = [p for f in self.fragments for p in f.params]
        sent = mean_gradients(params, weight, items, self.group)
        self._bytes += sent
        self._exact_bytes += sent

    def _warmup_step(self) -> bool:
        """Whether the step just counted was a warm-up step; the last one ends the warm-up."""
        if self._steps > self.schedule.warmup:
            return False
        if self._steps == self.schedule.warmup:
            self._end_warmup()
        return True

    def _end_warmup(self) -> None:
        """The replicas are identical: the global copy becomes them, buffers are averaged
        (item-weighted), and the first local interval starts here."""
        items = self.fragments[0].items
        with torch.no_grad():
            for f in self.fragments:
                for a, p in zip(f.anchors, f.params):
                    a.copy_(p)
                f.items, f.last_sent = 0.0, self._steps
        sent = self._sync_buffers(items)
        self._bytes += sent
        self._exact_bytes += sent
