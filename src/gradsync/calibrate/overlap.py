"""How much backward and an in-flight all-reduce slow each other down (measured).

On CPU, gloo moves and sums the bytes with CPU threads of the training processes
themselves, so with as many workers as cores an overlapped all-reduce is not free:
it takes cycles from backward, and backward from it. The DDP paper's overlap
argument (arXiv 2006.15704, section 3.2.3) assumes the communication is carried
by other hardware; here we measure how far that holds and give the simulator two
constants (plan/contention.py):

* ``f``: backward's rate is ``1 - f`` while an all-reduce is in flight;
* ``g``: the all-reduce's rate is ``1 - g`` while backward computes.

Per repetition, on every worker at once: (a) backward alone; (b) a chain of
all-reduces launched just before backward, sized to outlast it; (c) the same
chain alone. With ``W`` the overlapped wall time, (b)'s backward ``B_w = B_a +
f W`` and (b)'s chain ``T_w = C + g W``. Medians over repetitions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class OverlapPenalty:
    compute: float  # f
    comm: float  # g
    backward_alone_s: float
    backward_with_comm_s: float
    comm_alone_s: float
    comm_with_backward_s: float
    comm_bytes: int


def _clamp(x: float) -> float:
    return min(0.95, max(0.0, x))


def chain_bytes(backward_s: float, seconds_per_byte: float, cap: int = 256 << 20) -> int:
    """Bytes whose all-reduce alone lasts 3x the backward alone, capped.

    The chain must outlast the overlapped backward (which it slows) or its
    completion is only seen when backward returns; 3x leaves room for f + g ~ 1.
    """
    n = int(3.0 * backward_s / max(seconds_per_byte, 1e-12))
    return max(1 << 20, min(cap, n)) // (4 * 4 * 64) * (4 * 4 * 64)


def measure_overlap_worker(work, dp, backward_s: float, seconds_per_byte: float,
                           reps: int = 3) -> OverlapPenalty:
    """Inside a spawned worker with ``dp`` (DataParallel of ``work.model``)."""
    import torch

    from ..dist import comm_device
    from ..engine.transport import comm

    dev = comm_device()
    size = torch.tensor([chain_bytes(backward_s, seconds_per_byte)], dtype=torch.int64,
                        device=dev)
    comm.broadcast(size, 0, tag="calibrate")  # every rank issues identical collectives
    nbytes = int(size.item())
    bufs = [torch.ones(nbytes // 16, device=dev) for _ in range(4)]

    def chain():
        return [comm.all_reduce(b, async_op=True) for b in bufs]

    alone, with_b, c_alone, c_with = [], [], [], []
    with dp.no_sync():
        for _ in range(reps + 1):
            comm.barrier(tag="calibrate")
            loss = work.loss(dp)
            t0 = time.perf_counter()
            loss.backward()
            alone.append(time.perf_counter() - t0)

            loss = work.loss(dp)
            comm.barrier(tag="calibrate")
            t0 = time.perf_counter()
            pending = chain()
            loss.backward()
            t1 = time.perf_counter()
            for p in pending:
                p.wait()
            t2 = time.perf_counter()
            with_b.append(t1 - t0)
            c_with.append(t2 - t0)

            comm.barrier(tag="calibrate")
            t0 = time.perf_counter()
            for p in chain():
                p.wait()
            c_alone.append(time.perf_counter() - t0)
            dp.zero_grad()
    med = statistics.median
    a, bw, ca, cw = (med(x[1:]) for x in (alone, with_b, c_alone, c_with))  # drop warm-up
    w = max(1e-9, min(bw, cw))
    return OverlapPenalty(_clamp((bw - a) / w), _clamp((cw - ca) / w), a, bw, ca, cw, nbytes)
