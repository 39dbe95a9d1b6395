"""One calibration: the link's alpha and beta and the model's backward, in one launch.

``calibrate()`` times the model alone in this process first (compute without
interference), then starts K workers once: they time the collectives, then
the model's backward inside DataParallel under ``no_sync`` (all K computing at
once, as in a training step), then how much an in-flight all-reduce and
backward slow each other (overlap.py). The profile it returns uses the K-worker timing,
because that is the compute a K-worker step gets when the workers share the
machine's cores; the ratio of the two is reported as the co-running slowdown.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..errors import UsageError
from ..plan.profile import StepProfile
from .backward import BackwardTiming, measure_single, worker_measure
from .collectives import (
    OPS,
    CollectiveCalibration,
    default_sizes,
    summarise,
    time_collectives_worker,
)
from .overlap import OverlapPenalty
from .workload import check_spec


@dataclass(frozen=True)
class Calibration:
    spec: str
    workers: int
    collectives: CollectiveCalibration
    single: BackwardTiming  # one process alone
    contended: BackwardTiming  # rank 0 of K workers computing at once
    overlap: OverlapPenalty  # backward and all-reduce sharing the cores
    profile: StepProfile  # what `gradsync simulate --profile` reads
    overlap_in_profile: bool = True  # False: the profile assumes free overlap

    @property
    def corun_slowdown(self) -> float:
        """Backward time with K workers computing at once over backward time alone."""
        return self.contended.backward_s / self.single.backward_s


def _worker(spec, micro_batch, seq_len, ops, sizes, reps, runs, warmup):
    timings = time_collectives_worker(ops, sizes, reps)
    backward, overlap = worker_measure(spec, micro_batch, seq_len, runs, warmup,
                                       seconds_per_byte(timings, sizes), max(2, runs // 2 + 1))
    return timings, backward, overlap


def seconds_per_byte(timings, sizes) -> float:
    """This rank's all-reduce seconds per byte at the largest size (sizes the overlap chain)."""
    import statistics

    return statistics.median(timings["all_reduce"][-1]) / sizes[-1]


@contextlib.contextmanager
def _one_thread():
    """Workers compute on one intra-op thread each; time the lone process the same way."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def calibrate(spec: str = "gpt", workers: int = 2, micro_batch: int | None = None,
              seq_len: int | None = None, quick: bool = False, ops=OPS,
              reps: int | None = None, runs: int | None = None,
              sizes=None, overlap_penalties: bool = True) -> Calibration:
    """Measure alpha/beta on ``workers`` processes and the model's backward; build the profile.

    The overlap penalties are always measured and reported; with
    ``overlap_penalties=False`` the profile assumes free overlap instead (the
    model of a machine where other hardware moves the bytes). On this project's
    2-core machine the penalties were what brought the MLP's predictions within
    15% when the machine was otherwise quiet (docs/calibrate.md).
    """
    if not isinstance(workers, int) or workers < 2:
        raise UsageError(f"--workers must be an integer >= 2 (collectives need a peer), "
                         f"got {workers!r}")
    for flag, v in (("--micro-batch", micro_batch), ("--seq-len", seq_len)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    check_spec(spec)
    reps = reps or (5 if quick else 9)
    runs = runs or (3 if quick else 7)
    warmup = 1 if quick else 2
    sizes = list(sizes) if sizes is not None else default_sizes(quick)
    with _one_thread():
        single = measure_single(spec, micro_batch, seq_len, runs, warmup)
    from ..launch import spawn

    results = spawn(_worker, workers, spec, micro_batch, seq_len, tuple(ops), tuple(sizes),
                    reps, runs, warmup)
    coll = summarise([r[0] for r in results], sizes, reps)
    contended, overlap = results[0][1], results[0][2]
    f, g = (overlap.compute, overlap.comm) if overlap_penalties else (0.0, 0.0)
    profile = contended.to_profile(coll.alpha_s, coll.beta_s_per_byte, workers, f, g)
    return Calibration(spec, workers, coll, single, contended, overlap, profile,
                       overlap_penalties)
