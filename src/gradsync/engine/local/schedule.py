"""When a local-update run syncs, and how hard its first outer steps push.

DiLoCo at a fixed H from the first step ended 27% above synchronous training at
equal samples on the built-in GPT. The literature's answers for that regime are
each an option here, all off by default (a run without them is the DiLoCo it was,
bit for bit: tested):

1. **Synchronous warm-up** (post-local SGD, Lin et al., arXiv 1808.07217, section 3;
   torch's ``PostLocalSGDOptimizer(start_localSGD_iter=W)``): the first W inner steps
   are exact synchronous data parallelism -- the model's backward sums every
   worker's gradient with its items and divides by the global count (gradsync's
   exact weighting, not DDP's average of means; ``exchange.mean_gradients``), so the
   replicas stay identical through the phase where the loss falls fastest and
   replicas would drift furthest. After step W the global copy is reset to the
   parameters and local steps begin; syncs come every H steps counted from W.
2. **Outer-momentum warm-up**: the outer optimizer's ``momentum`` at a fragment's
   k-th outer step (k = 1, 2, ...) is ``m * min(1, (k - 1) / K)``: 0 at the first,
   ``m`` from step K + 1 on. Why: torch's SGD starts its buffer at the first
   pseudo-gradient, so DiLoCo's first Nesterov step moves ``(1 + m)`` times it
   (1.9 x 0.7 = 1.33 times for the paper's values), from replicas that have only
   just left one point. While the ramped momentum is 0 torch keeps no buffer: the
   buffer starts at k = 2 from that step's pseudo-gradient.
3. **An H that grows as the learning rate decays**: after a sync at step s the
   next comes ``clamp(floor(H * lr_peak / lr_now + 1/2), H, M)`` steps later, where
   ``lr_now`` is the inner learning rate of step s and ``lr_peak`` the largest seen
   so far (so a learning-rate warm-up keeps H). Small steps move the replicas
   apart slowly, so the same drift takes more of them; the Quadratic
   Synchronization Rule (Gu et al., arXiv 2310.14423) grows H as ``(alpha /
   lr)^2`` for the same reason, linear here and capped at M so a schedule decaying
   to 0 still syncs. DiLoCo only: streaming's staggered fragment offsets assume
   one fixed H.

The position in all three (steps since warm-up, next sync, peak learning rate,
each fragment's outer steps) is checkpoint state.
"""

from __future__ import annotations

import math

from ...errors import UsageError


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} must be an int >= {low}, got {value!r}")


class SyncSchedule:
    """The steps a DiLoCo run syncs at: warm-up W, interval H (growing up to M), the
    outer momentum ramp over K outer steps (module docstring)."""

    def __init__(self, every: int, warmup: int = 0, momentum_warmup: int = 0,
                 every_max: int = 0):
        _check_int("warmup_steps", warmup, 0)
        _check_int("outer_momentum_warmup", momentum_warmup, 0)
        _check_int("sync_every_max", every_max, 0)
        if every_max and every_max < every:
            raise UsageError(f"sync_every_max ({every_max}) must be 0 (H fixed) or at least "
                             f"sync_every ({every})")
        self.every, self.warmup = every, warmup
        self.momentum_warmup, self.every_max = momentum_warmup, every_max
        self.next_sync = warmup + every  # DiLoCo's next whole-model sync
        self.peak_lr = 0.0

    # ------------------------------------------------------------------ warm-up
    def warming_up(self, steps: int) -> bool:
        """Whether the inner step after ``steps`` completed ones is a synchronous one."""
        return steps < self.warmup

    # ------------------------------------------------------------------ the interval
    def observe(self, lr: float) -> None:
        self.peak_lr = max(self.peak_lr, lr)

    def interval(self, lr: float) -> int:
        """Steps from a sync taken at learning rate ``lr`` to the next one."""
        if not self.every_max:
            return self.every
        if not lr > 0:
            return self.every_max
        grown = math.floor(self.every * self.peak_lr / lr + 0.5)
        return min(self.every_max, max(self.every, grown))

    def due(self, steps: int) -> bool:
        return steps == self.next_sync

    def synced(self, steps: int, lr: float) -> None:
        self.next_sync = steps + self.interval(lr)

    def fragment_due(self, steps: int, offset: int) -> bool:
        """Streaming DiLoCo: fragment with ``offset`` is sent at step ``steps``."""
        return steps > self.warmup and (steps - self.warmup - offset) % self.every == 0

    # ------------------------------------------------------------------ momentum
    def momentum(self, base: float, k: int) -> float:
        """The outer momentum at a fragment's k-th outer step (k >= 1)."""
        if not self.momentum_warmup:
            return base
        return base * min(1.0, (k - 1) / self.momentum_warmup)

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict:
        return {"warmup": self.warmup, "momentum_warmup": self.momentum_warmup,
                "every_max": self.every_max}

    def state_dict(self) -> dict:
        return {**self.config(), "next_sync": self.next_sync, "peak_lr": self.peak_lr}

    def load_state_dict(self, state: dict | None, steps: int, what: str) -> None:
        """``state`` None: a checkpoint from before these options (fixed H, no warm-up)."""
        saved = {k: state[k] for k in self.config()} if state else \
            {"warmup": 0, "momentum_warmup": 0, "every_max": 0}
        if saved != self.config():
            raise UsageError(f"{what}.load_state_dict: saved with {saved}, this one has "
                             f"{self.config()}")
        if state:
            self.next_sync, self.peak_lr = int(state["next_sync"]), float(state["peak_lr"])
        else:
            self.next_sync = steps - steps % self.every + self.every
