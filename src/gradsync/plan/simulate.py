"""Event simulation of one data-parallel step: backward, bucketed all-reduces, overlap.

Why a simulator: the bucket size trades latency (many small all-reduces, one
alpha each) against overlap (one giant all-reduce cannot start before backward
ends). The DDP paper (arXiv 2006.15704, section 3.2.3 and figure 2) shows the
valley; this reproduces it from a profile so the choice can be made before
launching, and it calls the engine's own ``plan_buckets`` so the buckets
simulated are exactly the buckets that run.

Model (one communication lane, as the engine's single process group):

* forward takes ``forward_s``; backward visits parameters in reverse
  registration order, each gradient ready after its ``backward_s``;
* bucket k launches at max(its last gradient ready, bucket k-1's end) -- strictly
  in index order, as the engine launches -- and costs
  ``alpha + 2(N-1)/N * bytes * beta`` (ring all-reduce; alpha is the per-collective
  latency of the alpha-beta model, Thakur, Rabenseifner & Gropp 2005); nothing is
  sent when N = 1;
* the optimizer starts when both backward and the last bucket are done;
* with gradient accumulation over m micro-steps, the first m-1 run forward and
  backward only (``no_sync``) and communication happens on the last.

Scaling efficiency is the single-worker step over the K-worker step at the same
per-worker batch: compute-only time over simulated time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.buckets.plan import mb_to_bytes, plan_buckets
from ..errors import UsageError
from .contention import contended_schedule
from .profile import StepProfile

DEFAULT_BUCKET_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0


def allreduce_cost(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Ring all-reduce of one bucket: alpha + 2(N-1)/N * bytes * beta; free at N = 1."""
    if world_size <= 1:
        return 0.0
    return alpha + 2.0 * (world_size - 1) / world_size * nbytes * beta


@dataclass(frozen=True)
class BucketEvent:
    index: int
    nbytes: int
    n_params: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class GradEvent:
    """Backward of one parameter in the last micro-step (timeline compute lane)."""

    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepResult:
    bucket_cap_mb: float
    first_bucket_mb: float
    accum_steps: int
    forward_s: float  # all micro-steps
    backward_s: float  # all micro-steps
    optimizer_s: float
    compute_s: float  # forward + backward + optimizer: the single-worker step
    comm_s: float  # sum of bucket all-reduce durations
    step_s: float
    exposed_s: float  # step - compute: communication not hidden behind backward
    efficiency: float  # compute_s / step_s
    last_backward_start_s: float
    backward_end_s: float
    buckets: tuple[BucketEvent, ...]
    grads: tuple[GradEvent, ...]


def simulate_step(
    profile: StepProfile,
    bucket_cap_mb: float = DEFAULT_BUCKET_MB,
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
    accum_steps: int = 1,
) -> StepResult:
    """Simulate one optimizer step (``accum_steps`` micro-steps, sync on the last)."""
    if accum_steps < 1:
        raise UsageError(f"accumulation steps must be >= 1, got {accum_steps}")
    try:
        cap, first = mb_to_bytes(bucket_cap_mb), mb_to_bytes(first_bucket_mb)
    except ValueError as e:
        raise UsageError(str(e)) from None
    params = profile.params
    buckets = plan_buckets(profile.specs(), cap, first)

    micro = profile.forward_s + profile.backward_s
    t = (accum_steps - 1) * micro + profile.forward_s  # start of the last backward
    bwd_start = t
    f, g = profile.overlap_compute_penalty, profile.overlap_comm_penalty
    if (f or g) and profile.world_size > 1:
        return _contended(profile, buckets, bucket_cap_mb, first_bucket_mb, accum_steps,
                          micro, bwd_start)
    ready = [0.0] * len(params)
    grads = []
    for i in range(len(params) - 1, -1, -1):  # reverse registration order
        end = t + params[i].backward_s
        grads.append(GradEvent(params[i].name, t, end))
        ready[i] = end
        t = end
    bwd_end = t

    events, lane, comm = [], bwd_start, 0.0
    for b in buckets:
        r = max(ready[i] for i in b.params)
        start = max(r, lane)
        dur = allreduce_cost(b.nbytes, profile.world_size, profile.alpha_s, profile.beta_s_per_byte)
        lane = start + dur
        comm += dur
        events.append(BucketEvent(b.index, b.nbytes, len(b.params), r, start, lane))

    return _result(profile, bucket_cap_mb, first_bucket_mb, accum_steps, micro, bwd_start,
                   bwd_end, lane, comm, events, grads)


def _result(profile, bucket_cap_mb, first_bucket_mb, accum_steps, micro, bwd_start, bwd_end,
            lane, comm, events, grads) -> StepResult:
    step = max(bwd_end, lane) + profile.optimizer_s
    compute = accum_steps * micro + profile.optimizer_s
    return StepResult(
        bucket_cap_mb=float(bucket_cap_mb),
        first_bucket_mb=float(first_bucket_mb),
        accum_steps=accum_steps,
        forward_s=accum_steps * profile.forward_s,
        backward_s=accum_steps * profile.backward_s,
        optimizer_s=profile.optimizer_s,
        compute_s=compute,
        comm_s=comm,
        step_s=step,
        exposed_s=step - compute,
        efficiency=compute / step if step > 0 else 1.0,
        last_backward_start_s=bwd_start,
        backward_end_s=bwd_end,
        buckets=tuple(events),
        grads=tuple(grads),
    )


def _contended(profile, buckets, bucket_cap_mb, first_bucket_mb, accum_steps, micro, bwd_start):
    """The last backward with overlap penalties (plan/contention.py): cores are shared."""
    params = profile.params
    costs = [allreduce_cost(b.nbytes, profile.world_size, profile.alpha_s,
                            profile.beta_s_per_byte) for b in buckets]
    spans, ready, bspans = contended_schedule(
        [p.backward_s for p in params], bwd_start, [b.params for b in buckets], costs,
        profile.overlap_compute_penalty, profile.overlap_comm_penalty)
    grads = [GradEvent(params[i].name, s, e) for i, s, e in spans]
    bwd_end = spans[-1][2] if spans else bwd_start
    events = [BucketEvent(b.index, b.nbytes, len(b.params), max(ready[i] for i in b.params),
                          s, e) for b, (s, e) in zip(buckets, bspans)]
    lane = events[-1].end_s if events else bwd_start
    comm = sum(e.end_s - e.start_s for e in events)
    return _result(profile, bucket_cap_mb, first_bucket_mb, accum_steps, micro, bwd_start,
                   bwd_end, lane, comm, events, grads)


def sweep_sizes_mb(lo: float = 1.0, hi: float = 2048.0, points: int = 49) -> list[float]:
    """Log-spaced bucket sizes from 1 MB to 2 GB (MiB, as DDP counts), plus the 25 MB default."""
    if not (0 < lo < hi) or points < 2:
        raise UsageError(f"bad sweep range {lo}..{hi} MB with {points} points")
    step = math.log(hi / lo) / (points - 1)
    sizes = {round(lo * math.exp(k * step), 6) for k in range(points)}
    sizes.add(DEFAULT_BUCKET_MB)
    return sorted(sizes)


@dataclass(frozen=True)
class Sweep:
    sizes_mb: tuple[float, ...]
    step_s: tuple[float, ...]
    exposed_s: tuple[float, ...]
    optimum_mb: float
    optimum_s: float
    default_mb: float
    default_s: float


def sweep_bucket_sizes(
    profile: StepProfile,
    sizes_mb: Sequence[float] | None = None,
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
    accum_steps: int = 1,
) -> Sweep:
    """Step time at each bucket size; the optimum is the smallest size reaching the minimum."""
    sizes = list(sizes_mb) if sizes_mb is not None else sweep_sizes_mb()
    results = [simulate_step(profile, s, first_bucket_mb, accum_steps) for s in sizes]
    steps = [r.step_s for r in results]
    best = min(range(len(sizes)), key=lambda k: (steps[k], sizes[k]))
    default = simulate_step(profile, DEFAULT_BUCKET_MB, first_bucket_mb, accum_steps)
    return Sweep(
        tuple(sizes), tuple(steps), tuple(r.exposed_s for r in results),
        sizes[best], steps[best], DEFAULT_BUCKET_MB, default.step_s,
    )
