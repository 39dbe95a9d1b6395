"""Choose the bucket cap by measuring it, during the first synchronised steps.

Why measure rather than predict: the best cap depends on the backend's latency
and bandwidth, on the model's layer sizes and on how much communication slows
compute when both share the machine (on a 2-core CPU box, a lot). The planner's
simulator answers "which cap?" before a run; this answers it inside the run, on
the real thing, at the cost of a few steps.

Every candidate is a complete, correct training step (bucket boundaries change
only which gradients travel together), so tuning loses no work. The measured
quantity is the synchronised backward from its first gradient hook to the end
of the wait for the last bucket: compute plus exposed communication, the only
part of a step the cap changes. Each rank measures its own; the decision takes
the slowest rank's median per candidate (one small all-reduce with MAX), so all
ranks pick the same cap and the cap that suits the slowest rank.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

MIB = 1024 * 1024
SMALLEST_CAP_MB = 0.25
MAX_CANDIDATES = 10


@dataclass
class AutotuneResult:
    candidates_mb: list[float]
    median_s: list[float] = field(default_factory=list)
    chosen_mb: float | None = None

    def rows(self) -> list[tuple[float, float]]:
        return list(zip(self.candidates_mb, self.median_s))


def candidate_caps_mb(total_bytes: int) -> list[float]:
    """Caps doubling from 0.25 MiB up to one bucket holding every gradient.

    A doubling that lands within 10% of the whole model is dropped: it would
    measure the same single bucket twice.
    """
    total_mb = max(total_bytes / MIB, SMALLEST_CAP_MB)
    caps, cap = [], SMALLEST_CAP_MB
    while cap < 0.9 * total_mb:
        caps.append(cap)
        cap *= 2
    caps.append(total_mb)
    if len(caps) > MAX_CANDIDATES:  # keep the range, thin the middle
        step = (len(caps) - 1) / (MAX_CANDIDATES - 1)
        caps = [caps[round(i * step)] for i in range(MAX_CANDIDATES)]
    return caps


class BucketAutotuner:
    """Walks the candidates, ``warmup + measure`` synchronised steps each."""

    def __init__(self, total_bytes: int, measure: int = 3, warmup: int = 1):
        if measure < 1 or warmup < 0:
            raise ValueError("measure must be >= 1 and warmup >= 0")
        self.result = AutotuneResult(candidate_caps_mb(total_bytes))
        self.measure, self.warmup = measure, warmup
        self._index = 0
        self._samples: list[float] = []
        self._seen = 0

    @property
    def done(self) -> bool:
        return self.result.chosen_mb is not None

    @property
    def current_mb(self) -> float:
        if self.done:
            return self.result.chosen_mb
        return self.result.candidates_mb[self._index]

    def record(self, seconds: float) -> str:
        """Feed one step's measurement; returns 'stay', 'next' (switch cap) or 'decide'."""
        self._seen += 1
        if self._seen > self.warmup:
            self._samples.append(seconds)
        if len(self._samples) < self.measure:
            return "stay"
        self.result.median_s.append(statistics.median(self._samples))
        self._samples, self._seen = [], 0
        self._index += 1
        return "decide" if self._index == len(self.result.candidates_mb) else "next"

    def decide(self, slowest_rank_medians: list[float]) -> float:
        self.result.median_s = list(slowest_rank_medians)
        best = min(range(len(slowest_rank_medians)), key=slowest_rank_medians.__getitem__)
        self.result.chosen_mb = self.result.candidates_mb[best]
        return self.result.chosen_mb
