"""Time the real backend's collectives on K processes and fit alpha and beta.

Why measure rather than assume: on gloo/CPU the three collectives a data-parallel
engine uses differ by more than their textbook volumes suggest (on this
project's 2-core machine, gloo over loopback: a 34 MB reduce-scatter took 55 ms,
an all-gather 45 ms, an all-reduce 35 ms, where the textbook says the first two
move half the all-reduce's bytes; docs/zero.md has a later, fuller table), so
the simulator's cost per bucket must come from this machine. Each size is timed
``reps`` times after a barrier; a repetition's time is the slowest rank's (a
collective is done when every rank is done) and the size's figure is the median
over repetitions, which shrugs off the scheduling hiccups of a shared machine.

The fit is ``t = alpha + b * bytes`` per op (``plan.calibrate_fit``, relative
weighting, so small-message latency is pinned as well as large-message
bandwidth). The simulator charges an all-reduce ``alpha + 2(N-1)/N * bytes *
beta`` (``beta`` per byte of the *link*), so the profile's beta is ``b`` divided
by ``2(N-1)/N``; at N = 2 the two coincide.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..plan.calibrate_fit import AlphaBetaFit, fit_alpha_beta

OPS = ("all_reduce", "reduce_scatter", "all_gather")
ITEMSIZE = 4  # float32, as the engine's gradient buckets


def log_sizes(lo_bytes: int, hi_bytes: int, points: int) -> list[int]:
    """Log-spaced message sizes in bytes, each a multiple of 4 x 64 (divisible by any K <= 64)."""
    if not (0 < lo_bytes <= hi_bytes) or points < 2:
        raise UsageError(f"bad size range {lo_bytes}..{hi_bytes} bytes with {points} points")
    step = math.log(hi_bytes / lo_bytes) / (points - 1)
    quantum = ITEMSIZE * 64
    return sorted({max(quantum, round(lo_bytes * math.exp(k * step) / quantum) * quantum)
                   for k in range(points)})


def default_sizes(quick: bool) -> list[int]:
    """4 KB .. 64 MB in 9 points; ``quick``: 4 KB .. 16 MB in 5 points."""
    return log_sizes(4096, 16 << 20, 5) if quick else log_sizes(4096, 64 << 20, 9)


@dataclass(frozen=True)
class OpTiming:
    """One collective's medians per size and its alpha-beta fit (t = alpha + b * bytes)."""

    op: str
    world_size: int
    nbytes: tuple[int, ...]
    median_s: tuple[float, ...]
    fit: AlphaBetaFit

    @property
    def algbw(self) -> tuple[float, ...]:
        """Algorithmic bandwidth per size, bytes/s (message bytes over time)."""
        return tuple(n / t for n, t in zip(self.nbytes, self.median_s))


@dataclass(frozen=True)
class CollectiveCalibration:
    world_size: int
    reps: int
    ops: dict[str, OpTiming]

    @property
    def alpha_s(self) -> float:
        """Latency per all-reduce, the simulator's alpha."""
        return self.ops["all_reduce"].fit.alpha_s

    @property
    def beta_s_per_byte(self) -> float:
        """Link seconds per byte as the simulator's ring model reads it (see module doc)."""
        n = self.world_size
        b = self.ops["all_reduce"].fit.beta_s_per_byte
        return b if n <= 1 else b / (2.0 * (n - 1) / n)


def _issue(op: str, nbytes: int, world: int):
    """Buffers for one op and a closure that runs it synchronously through engine.comm."""
    import torch

    from ..dist import comm_device
    from ..engine.transport import comm

    numel, dev = nbytes // ITEMSIZE, comm_device()
    if op == "all_reduce":
        buf = torch.ones(numel, device=dev)
        return lambda: comm.all_reduce(buf)
    if op == "reduce_scatter":
        inp, out = torch.ones(numel, device=dev), torch.empty(numel // world, device=dev)
        return lambda: comm.reduce_scatter_single(out, inp)
    if op == "all_gather":  # nbytes is the gathered (output) size, as the op's event reports
        inp, out = torch.ones(numel // world, device=dev), torch.empty(numel, device=dev)
        return lambda: comm.all_gather_single(out, inp)
    raise UsageError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def time_collectives_worker(ops: Sequence[str], sizes: Sequence[int], reps: int,
                            warmup: int = 2) -> dict[str, list[list[float]]]:
    """Run inside a spawned worker: {op: [[seconds per op, per rep] per size]} of this rank.

    A barrier precedes every repetition so all ranks start together; each
    repetition's slowest rank is taken by the caller. Messages under 1 MB run
    several times back to back per repetition (time divided by the count), so
    the barrier's exit skew and the timer do not swamp a sub-millisecond op.
    """
    import torch.distributed as dist

    from ..engine.transport import comm

    world = dist.get_world_size()
    out: dict[str, list[list[float]]] = {}
    for op in ops:
        rows = []
        for n in sizes:
            run = _issue(op, n, world)
            inner = max(1, min(8, (1 << 20) // max(n, 1)))
            for _ in range(warmup * inner):
                run()
            times = []
            for _ in range(reps):
                comm.barrier(tag="calibrate")
                t0 = time.perf_counter()
                for _ in range(inner):
                    run()
                times.append((time.perf_counter() - t0) / inner)
            rows.append(times)
        out[op] = rows
    return out


def summarise(per_rank: Sequence[dict[str, list[list[float]]]], sizes: Sequence[int],
              reps: int) -> CollectiveCalibration:
    """Slowest rank per repetition, median per size, fit per op."""
    world = len(per_rank)
    result = {}
    for op in per_rank[0]:
        medians = []
        for k in range(len(sizes)):
            slowest = [max(r[op][k][j] for r in per_rank) for j in range(reps)]
            medians.append(statistics.median(slowest))
        fit = fit_alpha_beta(sizes, medians)
        result[op] = OpTiming(op, world, tuple(int(s) for s in sizes), tuple(medians), fit)
    return CollectiveCalibration(world, reps, result)


def _spawned(ops, sizes, reps):
    return time_collectives_worker(ops, sizes, reps)


def time_collectives(world_size: int = 2, sizes: Sequence[int] | None = None, reps: int = 5,
                     ops: Sequence[str] = OPS, quick: bool = False) -> CollectiveCalibration:
    """Spawn ``world_size`` workers, time ``ops`` at ``sizes`` bytes, fit alpha and beta."""
    if not isinstance(world_size, int) or world_size < 2:
        raise UsageError(f"timing collectives needs at least 2 workers, got {world_size!r}")
    if reps < 1:
        raise UsageError(f"repetitions must be >= 1, got {reps}")
    unknown = [op for op in ops if op not in OPS]
    if unknown or "all_reduce" not in ops:
        raise UsageError(f"ops must include all_reduce and be among {', '.join(OPS)}")
    sizes = list(sizes) if sizes is not None else default_sizes(quick)
    from ..launch import spawn

    per_rank = spawn(_spawned, world_size, tuple(ops), tuple(sizes), reps)
    return summarise(per_rank, sizes, reps)
