"""One spawned worker of benchmarks/stragglers.py: torch DDP, gradsync even, gradsync balanced.

Every rank holds one torch DDP replica and one gradsync DataParallel replica of
the same model and runs alternating timed blocks (torch even split, gradsync
even split, gradsync balanced, then the reverse order, ...), so machine noise
and position in the round hit all three alike. Only the balanced blocks hold a
``BusyClock`` (a comm observer): what measuring costs is charged to balancing.
The straggler is emulated the same way in every mode: between forward and
backward the slow rank sleeps ``(1/speed - 1)`` times the compute that its
micro-batch costs on this machine, from a line ``a + b * n`` measured once at
the start (one process, no communication) and averaged over the ranks -- so the
slowness is the same in all three modes and does not depend on what a mode
measures. ``gradsync train --straggler`` sleeps at the same point, before the
gradient leaves (``train/step/straggler.py``), measuring the forward and estimating
the backward as it goes instead of from a calibrated line.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync as gs
from gradsync.models import build_model

MODES = ("torch DDP", "gradsync even", "gradsync balanced")
PER_RANK = {"mlp": 64, "gpt": 8}  # samples per rank on the even split
POOL = 256


def _task(name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        x, y = torch.randn(POOL, 1024, generator=g), torch.randn(POOL, 1024, generator=g)

        def loss(m, idx):
            return F.mse_loss(m(x[idx]), y[idx])

        return (lambda: build_model("mlp")), loss, torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}
    x = torch.randint(0, 256, (POOL, 128), generator=g)
    y = torch.randint(0, 256, (POOL, 128), generator=g)

    def loss(m, idx):
        logits = m(x[idx])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[idx].reshape(-1))

    return (lambda: build_model("gpt")), loss, torch.optim.AdamW, {"lr": 1e-4}


def _calibrate(make, loss, per_rank: int) -> tuple[float, float]:
    """Seconds of forward+backward for n samples, as a + b*n, agreed by every rank."""
    model = make()
    points = []
    for n in (max(1, per_rank // 4), per_rank):
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            loss(model, list(range(n))).backward()
            times.append(time.perf_counter() - t0)
        points.append((n, statistics.median(times[1:])))
    (n0, t0), (n1, t1) = points
    b = max(1e-9, (t1 - t0) / (n1 - n0))
    a = max(0.0, t0 - b * n0)
    both = torch.tensor([a, b], dtype=torch.float64)
    dist.all_reduce(both)
    both /= gs.world_size()
    return float(both[0]), float(both[1])


def _step(model, opt, loss, idx, delay_s: float, backward) -> None:
    out = loss(model, idx)
    if delay_s > 0:
        time.sleep(delay_s)
    backward(out, len(idx))
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(name: str, speeds: list[float], rounds: int, steps: int, seed: int = 0) -> dict:
    torch.set_num_threads(1)
    rank, world = gs.rank(), gs.world_size()
    make, loss, opt_cls, opt_kw = _task(name, seed)
    per_rank = PER_RANK[name]
    gb = per_rank * world
    a, b = _calibrate(make, loss, per_rank)
    factor = 1.0 / speeds[rank] - 1.0
    torch.manual_seed(seed)
    torch_model = DDP(make())
    torch_opt = opt_cls(torch_model.parameters(), **opt_kw)
    torch.manual_seed(seed)
    gs_model = gs.DataParallel(make())
    gs_opt = opt_cls(gs_model.parameters(), **opt_kw)
    even = gs.ShareBalancer(world, gb, enabled=False)
    balanced = gs.ShareBalancer(world, gb)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    shares: list[list[int]] = []
    order = torch.randperm(POOL, generator=torch.Generator().manual_seed(seed)).tolist() * 64
    cursor = 0
    for rnd in range(rounds + 1):  # round 0 warms every mode up and is not timed
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:  # no mode always goes first
            dist.barrier()
            # the clock's comm observer only where balancing needs it: its cost is balancing's
            clock = gs.BusyClock() if mode == "gradsync balanced" else None
            for k in range(steps):
                block, cursor = order[cursor:cursor + gb], (cursor + gb) % (POOL * 63)
                t0 = time.perf_counter()
                if clock is not None:
                    clock.start()
                if mode == "torch DDP":
                    idx = block[rank::world]
                    _step(torch_model, torch_opt, loss, idx, factor * (a + b * len(idx)),
                          lambda out, n: out.backward())
                else:
                    bal = balanced if mode == "gradsync balanced" else even
                    idx = bal.split(block)[rank]
                    _step(gs_model, gs_opt, loss, idx, factor * (a + b * len(idx)),
                          lambda out, n: gs_model.backward(out, num_items=n))
                    if bal.enabled:
                        samples, busy = bal.gather(len(idx), clock.busy_s())
                        bal.observe(len(shares) + 1, samples, busy)
                        shares.append(list(bal.counts))
                spent = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                if clock is not None and k == steps - 1:
                    clock.close()
                dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # the step is its slowest rank's
                if rnd > 0 and k >= 2:
                    times[mode].append(float(spent))
    return {"median_s": {m: statistics.median(v) for m, v in times.items()},
            "final_split": shares[-1] if shares else None, "calibration": (a, b),
            "changes": len(balanced.changes)}
