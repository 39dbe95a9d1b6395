"""Least-squares fit of the alpha-beta model to measured collective timings.

``gradsync calibrate`` (which spawns processes; not here) times a collective over a
range of message sizes; this turns the (bytes, seconds) samples into alpha (the
per-collective latency) and beta (seconds per byte) with a quality report, so a
poor fit (noisy machine, a protocol switch between small and large messages) is
visible instead of silently feeding the simulator.

Ordinary least squares on ``t = alpha + beta * n`` minimises absolute error, so
large messages dominate and small-message latency is poorly pinned; ``weighting=
"relative"`` minimises relative error instead (weights 1/t^2), which is what a
per-bucket cost model over 1 MB..2 GB needs. Both are closed-form, no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class AlphaBetaFit:
    alpha_s: float  # latency per collective, seconds
    beta_s_per_byte: float  # 1 / bandwidth
    r2: float  # coefficient of determination of the unweighted residuals
    max_rel_residual: float  # max |t - fit| / t over samples
    n_samples: int

    @property
    def bandwidth(self) -> float:
        return math.inf if self.beta_s_per_byte <= 0 else 1.0 / self.beta_s_per_byte

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def fit_alpha_beta(
    nbytes: Sequence[float],
    seconds: Sequence[float],
    weighting: str = "relative",
    clamp: bool = True,
) -> AlphaBetaFit:
    """Fit t = alpha + beta * n. ``clamp`` keeps alpha and beta >= 0 (refits the other)."""
    xs, ts = [float(x) for x in nbytes], [float(t) for t in seconds]
    if len(xs) != len(ts):
        raise UsageError(f"{len(xs)} sizes but {len(ts)} timings")
    if len(xs) < 2 or len(set(xs)) < 2:
        raise UsageError("need timings at two or more distinct message sizes")
    if any(x < 0 for x in xs) or any(not t > 0 for t in ts):
        raise UsageError("sizes must be >= 0 and timings > 0")
    if weighting not in ("relative", "absolute"):
        raise UsageError(f"unknown weighting {weighting!r}")
    ws = [1.0 / (t * t) for t in ts] if weighting == "relative" else [1.0] * len(ts)

    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    st = sum(w * t for w, t in zip(ws, ts))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * sxx - sx * sx
    beta = (sw * sxt - sx * st) / det
    alpha = (st - beta * sx) / sw
    if clamp and beta < 0:
        beta, alpha = 0.0, st / sw
    if clamp and alpha < 0:
        alpha, beta = 0.0, sxt / sxx

    pred = [alpha + beta * x for x in xs]
    mean = sum(ts) / len(ts)
    ss_tot = sum((t - mean) ** 2 for t in ts)
    ss_res = sum((t - p) ** 2 for t, p in zip(ts, pred))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    max_rel = max(abs(t - p) / t for t, p in zip(ts, pred))
    return AlphaBetaFit(alpha, beta, r2, max_rel, len(xs))
