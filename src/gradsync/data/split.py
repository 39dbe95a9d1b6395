"""How one step's global batch is divided over the ranks: counts, then which samples.

Pure functions (no process group, no clock), so every rank computes the same
answer from the same inputs and a property test can check them alone.

The even split is the special case of the weighted one: :func:`deal` hands out
a block's samples in a smooth weighted round-robin, which for equal counts is
exactly the interleaving ``block[r::K]`` that :meth:`StepSampler.share` gives.
So a balanced run whose split happens to be even takes the very same samples,
in the same order, as an unbalanced one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import UsageError


def bounds(global_batch: int, world: int, accumulation: int, min_share: float,
           max_share: float) -> tuple[int, int]:
    """(fewest, most) samples one rank may take, as counts.

    ``min_share`` / ``max_share`` are fractions of the even share ``B / K``. The
    floor is at least ``accumulation`` (every micro-batch holds a sample, so every
    rank runs the same forwards -- ZeRO-3 gathers inside them); the ceiling keeps
    a fast rank's largest micro-batch within ``max_share`` times the even one's,
    the memory it was planned for.
    """
    even = global_batch / world
    lo = max(accumulation, math.ceil(min_share * even - 1e-9))
    hi = max(lo, math.floor(max_share * even + 1e-9))
    if lo * world > global_batch or hi * world < global_batch:
        raise UsageError(f"no split of {global_batch} samples over {world} ranks keeps every "
                         f"share in [{lo}, {hi}] samples")
    return lo, hi


def split_counts(total: int, per_sample_s: Sequence[float], lo: int, hi: int,
                 fixed_s: Sequence[float] | None = None) -> list[int]:
    """``total`` samples over the ranks so the slowest one finishes first, counts in ``[lo, hi]``.

    Rank ``r`` is modelled as taking ``fixed_s[r] + per_sample_s[r] * n`` seconds
    for ``n`` samples (``fixed_s`` zero: plain proportion to speed). The common
    finishing time ``T`` with ``sum(clamp((T - fixed) / per_sample)) == total``
    is found by bisection; whole counts then start from the floors and each
    sample left goes to the rank that would finish earliest with it (ties to the
    lower rank), which keeps the slowest rank's time least. Equal speeds give the
    even split.
    """
    k = len(per_sample_s)
    fixed = [0.0] * k if fixed_s is None else [float(f) for f in fixed_s]
    if k == 0 or lo * k > total or hi * k < total or len(fixed) != k:
        raise UsageError(f"cannot split {total} samples over {k} ranks within [{lo}, {hi}]")
    if any(not (b > 0 and math.isfinite(b)) for b in per_sample_s) or \
            any(not (f >= 0 and math.isfinite(f)) for f in fixed):
        raise UsageError(f"every rank's time per sample must be a positive number, got "
                         f"{list(per_sample_s)} (fixed {fixed})")

    def share(t: float, r: int) -> float:
        return min(float(hi), max(float(lo), (t - fixed[r]) / per_sample_s[r]))

    low = min(fixed[r] + per_sample_s[r] * lo for r in range(k))
    high = max(fixed[r] + per_sample_s[r] * hi for r in range(k))
    for _ in range(100):
        mid = (low + high) / 2
        if sum(share(mid, r) for r in range(k)) < total:
            low = mid
        else:
            high = mid
    counts = [math.floor(share(high, r) + 1e-9) for r in range(k)]
    while sum(counts) > total:  # float slack: take back from the latest finisher
        r = max((i for i in range(k) if counts[i] > lo),
                key=lambda i: (fixed[i] + per_sample_s[i] * counts[i], -i))
        counts[r] -= 1
    while sum(counts) < total:
        r = min((i for i in range(k) if counts[i] < hi),
                key=lambda i: (fixed[i] + per_sample_s[i] * (counts[i] + 1), i))
        counts[r] += 1
    return counts


def deal(block: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Each rank's samples of ``block``: rank ``r`` gets ``counts[r]`` of them.

    Rank ``r``'s ``j``-th sample sits at the fraction ``(j + 1/2) / counts[r]`` of
    the block; merging every rank's fractions in order (ties to the lower rank)
    says who takes each position. Samples so spread evenly through the block,
    and equal counts deal ``block[r::K]`` exactly. O(B log B), the same on every
    rank (the same IEEE arithmetic on the same integers).
    """
    total = sum(counts)
    if total != len(block):
        raise UsageError(f"counts sum to {total} but the block holds {len(block)} samples")
    if len(set(counts)) == 1:
        k = len(counts)
        return [list(block[r::k]) for r in range(k)]
    slots = sorted(((j + 0.5) / c, r) for r, c in enumerate(counts) for j in range(c))
    parts: list[list[int]] = [[] for _ in counts]
    for index, (_, r) in zip(block, slots):
        parts[r].append(index)
    return parts


def micro_batches(share: Sequence[int], accumulation: int) -> list[list[int]]:
    """``share`` cut into ``accumulation`` consecutive micro-batches, sizes differing by <= 1.

    The larger ones come first. With a share divisible by ``accumulation`` this is
    the even cut every rank used before balancing.
    """
    n, a = len(share), accumulation
    base, extra = divmod(n, a)
    out, at = [], 0
    for k in range(a):
        size = base + (1 if k < extra else 0)
        out.append(list(share[at:at + size]))
        at += size
    return out


def step_time(counts: Sequence[int], per_sample_s: Sequence[float],
              fixed_s: Sequence[float] | None = None) -> float:
    """Predicted compute time of a step: the slowest rank's ``fixed + per_sample * count``."""
    fixed = fixed_s or [0.0] * len(counts)
    return max(f + b * c for c, b, f in zip(counts, per_sample_s, fixed))
