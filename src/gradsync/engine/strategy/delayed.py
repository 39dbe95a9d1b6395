"""What ``--compress-delay 1`` asks of the strategy around the delayed sums.

The sums themselves are ``compress/delayed.py``'s: step s's compressed gradient is
applied at step s+1. The loop does not change; :class:`CompressedStrategy`
(``inexact.py``) takes this mixin, which

* flushes at the end (:meth:`finish`): the last step's sum is waited for and
  applied with one more optimizer step, clipped to the same ``--clip`` the loop
  used, and skipped (on every rank alike: the sum is the same everywhere) if it is
  not finite -- so every step's gradient is applied once, none dropped;
* checkpoints the pending sum (:meth:`extra_state`: identical on every rank, so
  rank 0's copy is the state) after waiting for its communication, which also
  makes the gathered residuals those after that sum (:meth:`gather_state`);
* reports which step's gradient the update applied (``grad_steps``: [] at the
  first step, [s-1] at step s, [T-1, T] at the last one, where the flush adds T),
  and the bytes and probe distance of that gradient, so metrics and the probe
  line up with what the optimizer saw.

Clipping and ``--on-nonfinite`` act on the gradient in ``.grad``, which is the
applied (previous step's) one; that is the one they protect the model from.
``--probe-every`` works unchanged: a probed step's exact sum travels with its
compressed one and is compared when both are applied.
"""

from __future__ import annotations

import math

from ...errors import UsageError


class DelayedUpdates:
    """Mixin of CompressedStrategy (``self.reduction``: its CompressedBuckets)."""

    _max_norm = None  # the loop's --clip, remembered for the flush

    def clip_grad_norm_(self, max_norm):
        self._max_norm = max_norm
        return super().clip_grad_norm_(max_norm)

    def finish(self) -> None:
        """Apply the pending sum of the last step (see the module docstring)."""
        super().finish()
        if self.reduction.delayed is None:
            return
        self.optimizer.zero_grad(set_to_none=True)  # .grad holds the sum already applied
        if self.reduction.flush():
            norm = super().clip_grad_norm_(self._max_norm)
            if math.isfinite(float(norm)):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def gather_state(self) -> None:
        if self.reduction.delayed is not None:
            self.reduction.delayed.settle()  # residuals after the in-flight sums
        super().gather_state()

    def extra_state(self) -> dict:
        state = super().extra_state()
        if self.reduction.delayed is not None:
            state["pending"] = self.reduction.delayed.state_dict()
        return state

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        pending = (state or {}).get("pending")
        if self.reduction.delayed is not None:
            self.reduction.delayed.load_state_dict(pending)
        elif pending is not None:
            raise UsageError(f"the checkpoint holds step {pending['window']}'s compressed "
                             "gradient, not yet applied (it was written with --compress-delay "
                             "1): continue it with --compress-delay 1")

    def delayed_report(self) -> dict:
        """``step_report`` with a delay: the applied step(s), their bytes and probe."""
        steps, sent = self.reduction.delayed.take_applied()
        report = {"sent_bytes": sent, "grad_steps": steps}
        if self.reduction.last_distance is not None:
            report["grad_cosine"], report["grad_rel_error"] = self.reduction.last_distance
            self.reduction.last_distance = None
        return report

