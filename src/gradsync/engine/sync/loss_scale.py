"""Dynamic loss scaling for fp16: the scale, its policy, and the verdict of every sync.

fp16 has a 5-bit exponent: gradients of activations below 2**-24 flush to zero in
backward, and many real ones are that small. Mixed-precision training (Micikevicius
et al., arXiv 1710.03740, section 3.3) multiplies the loss by a scale S before
backward, so every gradient is S times larger and stays in fp16's range, divides S
out again before the update, and (the dynamic policy its implementations use)
halves S and skips the step whenever a gradient overflowed, doubling it again after
a run of finite steps.

Where gradsync keeps it:

* **The scale lives with the synchronised model** (``model.loss_scaler``), on the
  host, as a power of two: ``backward(loss, num_items=n)`` already multiplies the
  local mean loss by ``n``; it multiplies by ``n * S``. The sync already divides the
  summed gradient by the global item count ``N``; it divides by ``N * S``. Both are
  exact for a power of two (they change exponents only), so unscaling costs nothing
  and a float64 run with a scale equals the run without it bit for bit.
* **The verdict is taken at the end of every synchronised backward, on the device,**
  and read on the host once per sync (``core.py``; never per micro-batch: under
  ``no_sync`` nothing is checked). DataParallel's summed gradient is identical on
  every rank, so every rank reaches the same verdict with no collective; a sharded
  strategy (ZeRO 1-3) holds a different shard on each rank, so its flag is one
  8-byte all-reduce. An overflowed sync *drops* the gradients (``.grad`` None, the
  shards gone), so whatever optimizer steps next -- gradsync's or a plain torch
  one -- leaves parameters and state bitwise as they were: the step is skipped on
  every rank alike.
* **The scale changes only at a sync,** so every micro-batch of one accumulation
  window is scaled alike (the sum then divides exactly); what the gradients hold
  afterwards is already unscaled, so a later change never touches them.

An overflow at ``min_scale`` is not put down to scaling: the scale cannot back off
further, so the gradient is non-finite for a reason of its own (``verdict ==
"nonfinite"``: still dropped; ``gradsync train`` hands it to ``--on-nonfinite``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import UsageError


def _power_of_two(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
        and x > 0 and math.frexp(x)[0] == 0.5


@dataclass(frozen=True)
class LossScale:
    """How the loss scale starts and moves (the standard dynamic policy by default).

    Every factor is a power of two, so scaling and unscaling are exact (they move
    exponents, never mantissas).

    init_scale: the first step's scale (2**16, the common default: fp16's largest
        finite value is 65504, just under 2**16).
    growth_factor: the scale is multiplied by this after ``growth_interval``
        consecutive finite steps (2).
    backoff_factor: and by this after an overflow, whose step is skipped (0.5).
    growth_interval: finite synchronised steps between growths (2000).
    min_scale: the scale never backs off below this; an overflow *at* this scale is a
        real non-finite gradient, not one of scaling's (1: an unscaled fp16
        gradient that still overflows).
    dynamic: False keeps ``init_scale`` for the whole run (the paper's constant
        scaling); an overflow still skips its step.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    dynamic: bool = True

    def __post_init__(self) -> None:
        for name in ("init_scale", "min_scale"):
            if not _power_of_two(getattr(self, name)):
                raise UsageError(f"LossScale.{name} must be a power of two (scaling is then "
                                 f"exact), got {getattr(self, name)!r}")
        if not _power_of_two(self.growth_factor) or self.growth_factor < 2:
            raise UsageError(f"LossScale.growth_factor must be a power of two >= 2, got "
                             f"{self.growth_factor!r}")
        if not _power_of_two(self.backoff_factor) or self.backoff_factor >= 1:
            raise UsageError(f"LossScale.backoff_factor must be a power of two below 1 "
                             f"(0.5, 0.25, ...), got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise UsageError(f"LossScale.growth_interval must be an integer >= 1, got "
                             f"{self.growth_interval!r}")
        if self.init_scale < self.min_scale:
            raise UsageError(f"LossScale.init_scale ({self.init_scale:g}) is below min_scale "
                             f"({self.min_scale:g})")


class LossScaler:
    """The running scale of one synchronised model, and what its last sync decided.

    Attributes:
        scale: what the next backward multiplies the loss by.
        used: the scale the last synchronised backward divided out (None before one).
        verdict: the last sync's: ``"finite"``, ``"overflow"`` (gradients dropped, the
            scale backed off: the step is skipped) or ``"nonfinite"`` (overflow at
            ``min_scale``: dropped, and not scaling's doing); None before a sync.
        skipped: synchronised backwards skipped by loss scaling so far ("overflow").
        growth_tracker: finite syncs since the scale last changed.
    """

    def __init__(self, config: LossScale | None = None):
        self.config = config or LossScale()
        self.scale = float(self.config.init_scale)
        self.used: float | None = None
        self.verdict: str | None = None
        self.skipped = 0
        self.growth_tracker = 0

    @property
    def dropped(self) -> bool:
        """The last sync overflowed and its gradients were dropped (the step is skipped)."""
        return self.verdict in ("overflow", "nonfinite")

    def record(self, finite: bool) -> str:
        """The verdict of a sync (the same on every rank), and the scale it leaves."""
        cfg = self.config
        self.used = self.scale
        if finite:
            self.verdict = "finite"
            if cfg.dynamic:
                self.growth_tracker += 1
                if self.growth_tracker >= cfg.growth_interval:
                    self.scale *= cfg.growth_factor
                    self.growth_tracker = 0
        elif self.scale > cfg.min_scale:
            self.verdict = "overflow"
            self.skipped += 1
            self.growth_tracker = 0
            if cfg.dynamic:
                self.scale = max(self.scale * cfg.backoff_factor, float(cfg.min_scale))
        else:
            self.verdict = "nonfinite"
            self.growth_tracker = 0
        return self.verdict

    def state_dict(self) -> dict:
        """What a resumed run needs to continue bit for bit (the policy is the config's)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        scale = float(state["scale"])
        if not _power_of_two(scale):
            raise UsageError(f"a loss scale must be a power of two, the state holds {scale!r}")
        self.scale = scale
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped = int(state["skipped"])

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale:g}, skipped={self.skipped}, "
                f"growth_tracker={self.growth_tracker}, config={self.config})")
