"""RankSpeeds: what each rank's busy time per step looks like as a function of its share.

Each rank's measurements are kept per share size: the busy seconds of its last
``window`` steps at that share (their median stands for the share: one step
slowed by a page fault or a neighbour's burst does not move it), and the step
it was last seen at. A rank
measured at two or more shares gets a least-squares line ``fixed + per_sample *
n`` through its per-share medians -- a step has costs that do not grow with the
share (the last backward's hooks, per-layer kernels, copies into buckets), and a
model without them would over-correct and overstate what balancing saves. A
rank seen at one share only, or whose line is implausible (no positive slope,
a negative intercept), is modelled as plain proportion at its current share.
Shares not seen for ``forget`` steps are dropped, so a rank whose speed changed
mid-run is soon described by what it does now; at most ``keep`` shares per rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


class RankSpeeds:
    def __init__(self, world: int, window: int = 4, forget: int = 50, keep: int = 4):
        self.world, self.window, self.forget, self.keep = world, window, forget, keep
        # per rank: share -> (recent busy seconds at that share, last step seen)
        self._points: list[dict[int, tuple[list[float], int]]] = [{} for _ in range(world)]

    def record(self, step: int, samples: Sequence[float], busy_s: Sequence[float]) -> None:
        for r, (n, b) in enumerate(zip(samples, busy_s)):
            points = self._points[r]
            n = int(n)
            recent = (points[n][0] if n in points else []) + [float(b)]
            points[n] = (recent[-self.window:], step)
            for old in [k for k, (_, seen) in points.items() if step - seen > self.forget]:
                del points[old]
            while len(points) > self.keep:
                del points[min(points, key=lambda k: points[k][1])]

    def measured(self, counts: Sequence[int]) -> int:
        """Steps measured at ``counts`` on every rank (the fewest over ranks, <= window)."""
        return min(len(self._points[r].get(int(c), ([], 0))[0]) for r, c in enumerate(counts))

    def slowest(self, counts: Sequence[int]) -> float | None:
        """The largest of the ranks' median busy seconds at their shares in ``counts``."""
        out = []
        for r, c in enumerate(counts):
            recent = self._points[r].get(int(c), ([], 0))[0]
            if not recent:
                return None
            out.append(statistics.median(recent))
        return max(out)

    def rates(self, counts: Sequence[int]) -> list[float] | None:
        """Samples per busy second of every rank at its share in ``counts``."""
        out = []
        for r, c in enumerate(counts):
            recent = self._points[r].get(int(c), ([], 0))[0]
            if not recent or sum(recent) <= 0:
                return None
            out.append(c / statistics.median(recent))
        return out

    def model(self, counts: Sequence[int]) -> tuple[list[float], list[float]] | None:
        """Every rank's (seconds per sample, fixed seconds), or None if one is unmeasured."""
        rates = self.rates(counts)
        if rates is None:
            return None
        per, fixed = [1.0 / v for v in rates], [0.0] * self.world
        for r in range(self.world):
            pts = [(n, statistics.median(b)) for n, (b, _) in self._points[r].items()]
            if len(pts) < 2:
                continue
            mn = sum(n for n, _ in pts) / len(pts)
            mt = sum(t for _, t in pts) / len(pts)
            slope = (sum((n - mn) * (t - mt) for n, t in pts)
                     / sum((n - mn) ** 2 for n, _ in pts))
            icpt = mt - slope * mn
            if slope > 0 and icpt >= 0:
                per[r], fixed[r] = slope, icpt
        return per, fixed

    def state_dict(self) -> list[list[list]]:
        return [[[n, list(b), s] for n, (b, s) in p.items()] for p in self._points]

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, list) or len(state) != self.world:
            return
        self._points = [{int(n): ([float(x) for x in b], int(s)) for n, b, s in p}
                        for p in state]
