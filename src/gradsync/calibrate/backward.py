"""Per-parameter backward timing from the real model, and the profile built from it.

The simulator needs, for every parameter, when its gradient becomes ready during
backward: that is when the engine's bucket holding it can launch (DDP paper,
arXiv 2006.15704, section 3.2.3). We measure exactly that with
``register_post_accumulate_grad_hook`` -- the hook the engine itself uses -- as
seconds since ``backward()`` was called. Per parameter the median over ``runs``
passes is taken, then the time between consecutive ready events is attributed to
the parameter that arrived (the first one also carries the loss's own backward,
the last one the tail until ``backward()`` returns), so ``backward_s`` sums to
the measured backward exactly.

Two settings: ``measure_single`` runs in this process with no communication,
compute measured without interference; ``measure_under_workers`` runs K workers,
each inside ``DataParallel`` under ``no_sync`` (hooks and bucket views as in
training, no collective), which is the compute a K-worker step actually gets when
K processes share the machine's cores.

Order: the engine rebuilds its buckets once, in the order gradients actually
became ready. ``to_profile`` lists parameters so that *reversed* they are in the
observed ready order; for most models that is registration order unchanged, and
otherwise it makes the simulator (which walks reverse list order and buckets the
same way) see the buckets the engine really runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..errors import UsageError
from ..plan.profile import ParamProfile, StepProfile
from .workload import Workload, build_workload


@dataclass(frozen=True)
class BackwardTiming:
    """Medians over ``runs`` passes; per-parameter tuples are in registration order."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    itemsizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    ready_s: tuple[float, ...]  # gradient ready, seconds after backward() was called
    forward_s: float  # forward and loss
    backward_s: float  # backward() call to return
    optimizer_s: float  # optimizer step and zero_grad
    runs: int
    workers: int  # 1: one process alone; K: under DataParallel no_sync on K workers

    def ready_order(self) -> list[int]:
        """Parameter indices in the order their gradients became ready."""
        return sorted(range(len(self.names)), key=lambda i: (self.ready_s[i], -i))

    def per_param_s(self) -> list[float]:
        """Attributed backward seconds per parameter (registration order); sums to backward_s."""
        out = [0.0] * len(self.names)
        prev = 0.0
        order = self.ready_order()
        for i in order:
            t = max(prev, self.ready_s[i])
            out[i] = t - prev
            prev = t
        out[order[-1]] += max(0.0, self.backward_s - prev)
        return out

    def to_profile(self, alpha_s: float, beta_s_per_byte: float, world_size: int,
                   overlap_compute: float = 0.0, overlap_comm: float = 0.0) -> StepProfile:
        per = self.per_param_s()
        listed = list(reversed(self.ready_order()))
        params = tuple(ParamProfile(self.names[i], self.numels[i], self.itemsizes[i], per[i],
                                    self.dtypes[i]) for i in listed)
        return StepProfile(self.forward_s, params, self.optimizer_s, alpha_s, beta_s_per_byte,
                           world_size, overlap_compute, overlap_comm)


def _trainable(module):
    """Trainable parameters in registration order, tied ones once, with all their names."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return [(" = ".join(aliases[id(p)]), p) for p in module.parameters() if p.requires_grad]


def median_timing(timings: list[BackwardTiming]) -> BackwardTiming:
    """Element-wise median of timings of the same model taken at different times."""
    med = statistics.median
    first = timings[0]
    return BackwardTiming(
        first.names, first.numels, first.itemsizes, first.dtypes,
        ready_s=tuple(med(t.ready_s[i] for t in timings) for i in range(len(first.names))),
        forward_s=med(t.forward_s for t in timings), backward_s=med(t.backward_s for t in timings),
        optimizer_s=med(t.optimizer_s for t in timings), runs=sum(t.runs for t in timings),
        workers=first.workers)


def time_passes(work: Workload, model, runs: int, warmup: int, zero_grad,
                optimizer=None) -> BackwardTiming:
    """Run ``warmup + runs`` forward/backward/step passes; medians of the last ``runs``.

    ``model`` is ``work.model`` or a wrapper of it (DataParallel); hooks go on the
    underlying parameters and are removed afterwards. Pass ``optimizer`` to reuse
    one across calls (a fresh one allocates its state on its first step).
    """
    if runs < 1 or warmup < 0:
        raise UsageError(f"runs must be >= 1 and warm-up >= 0, got {runs} and {warmup}")
    named = _trainable(work.model)
    params = [p for _, p in named]
    stamps = [0.0] * len(params)
    seen = [0] * len(params)

    def make_hook(i):
        def hook(_p):
            stamps[i] = time.perf_counter()
            seen[i] += 1
        return hook

    handles = [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(params)]
    opt = optimizer if optimizer is not None else work.make_optimizer(params)
    ready_runs, fwd, bwd, step = [], [], [], []
    try:
        for k in range(warmup + runs):
            seen[:] = [0] * len(params)
            t0 = time.perf_counter()
            loss = work.loss(model)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            zero_grad()
            t3 = time.perf_counter()
            missing = [named[i][0] for i, c in enumerate(seen) if c != 1]
            if missing:
                raise UsageError(f"{len(missing)} parameter(s) got no gradient or several in one "
                                 f"backward (e.g. {missing[0]!r}); calibration needs every "
                                 "trainable parameter to take part in the loss once")
            if k >= warmup:
                ready_runs.append([s - t1 for s in stamps])
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                step.append(t3 - t2)
    finally:
        for h in handles:
            h.remove()
    med = statistics.median
    return BackwardTiming(
        names=tuple(n for n, _ in named),
        numels=tuple(p.numel() for p in params),
        itemsizes=tuple(p.element_size() for p in params),
        dtypes=tuple(str(p.dtype).replace("torch.", "") for p in params),
        ready_s=tuple(med(r[i] for r in ready_runs) for i in range(len(params))),
        forward_s=med(fwd), backward_s=med(bwd), optimizer_s=med(step), runs=runs, workers=1,
    )


def measure_single(spec: str, micro_batch: int | None = None, seq_len: int | None = None,
                   runs: int = 5, warmup: int = 2) -> BackwardTiming:
    """One process, no communication: the model's own compute."""
    work = build_workload(spec, micro_batch, seq_len)
    return time_passes(work, work.model, runs, warmup,
                       lambda: work.model.zero_grad(set_to_none=False))


def worker_measure(spec: str, micro_batch, seq_len, runs: int, warmup: int,
                   seconds_per_byte: float | None = None, overlap_reps: int = 3):
    """Inside a spawned worker: DataParallel under no_sync, timed with the same hooks.

    With ``seconds_per_byte`` (this rank's all-reduce cost) also measures the
    overlap penalties and returns ``(timing, OverlapPenalty)``.
    """
    import dataclasses

    import torch.distributed as dist

    from ..dist import comm_device
    from ..engine.replicated.data_parallel import DataParallel
    from ..engine.transport import comm

    work = build_workload(spec, micro_batch, seq_len, device=comm_device())
    dp = DataParallel(work.model)
    comm.barrier(tag="calibrate")
    with dp.no_sync():
        timing = time_passes(work, dp, runs, warmup, dp.zero_grad)
    comm.barrier(tag="calibrate")
    timing = dataclasses.replace(timing, workers=dist.get_world_size())
    if seconds_per_byte is None:
        return timing
    from .overlap import measure_overlap_worker

    return timing, measure_overlap_worker(work, dp, timing.backward_s, seconds_per_byte,
                                          overlap_reps)


def measure_under_workers(spec: str, workers: int, micro_batch: int | None = None,
                          seq_len: int | None = None, runs: int = 5,
                          warmup: int = 2) -> BackwardTiming:
    """K workers computing at once (no collectives): rank 0's timing."""
    from ..launch import spawn

    return spawn(worker_measure, workers, spec, micro_batch, seq_len, runs, warmup)[0]
