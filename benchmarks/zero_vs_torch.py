"""gradsync ZeRO 1/2/3 against torch's ZeroRedundancyOptimizer + DDP and FSDP2, side by side.

Same model (depth x (width x width Linear + GELU)), data, AdamW and process count
for every strategy. Strategies alternate in rounds (each (round, strategy) block is
a fresh group of workers, so one strategy's allocations never inflate another's
peak), and the summary prints median step times, ratios to the torch baselines and
peak memory per rank.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the growth of the
worker's peak RSS (``ru_maxrss``) over its RSS before the model was built (which
includes allocator slack, but is what the operating system had to provide).

Usage:
    PYTHONPATH=src python benchmarks/zero_vs_torch.py [--world 2] [--steps 8]
        [--rounds 3] [--width 1024] [--depth 8] [--batch 64]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs

STRATEGIES = ["ddp", "zero1", "torch_zero1", "zero2", "zero3", "torch_fsdp2"]
# variants, by name only (--only): the textbook collectives instead of the per-backend choice
VARIANTS = ["zero1_native", "zero2_native", "zero3_native", "zero3_prefetch2"]
BASELINE = {"zero1": "torch_zero1", "zero3": "torch_fsdp2", "zero2": "torch_zero1",
            "ddp": "torch_zero1", "zero1_native": "torch_zero1",
            "zero2_native": "torch_zero1", "zero3_native": "torch_fsdp2",
            "zero3_prefetch2": "torch_fsdp2"}


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return nn.functional.gelu(self.lin(x))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _build(strategy, width, depth):
    collectives = "native" if strategy.endswith("_native") else "auto"
    prefetch = 2 if strategy.endswith("_prefetch2") else 1
    strategy = strategy.removesuffix("_native").removesuffix("_prefetch2")
    torch.manual_seed(0)
    module = nn.Sequential(*[Block(width) for _ in range(depth)])
    kw = {"lr": 1e-4, "weight_decay": 0.01}
    if strategy == "ddp":
        model = gs.DataParallel(module)
        return model, torch.optim.AdamW(model.parameters(), **kw), True
    if strategy in ("zero1", "zero2"):
        model = gs.DataParallel(module)
        return model, gs.ZeroOptimizer(model, torch.optim.AdamW, stage=int(strategy[-1]),
                                       collectives=collectives, **kw), True
    if strategy == "zero3":
        model = gs.FullyShardedDataParallel(module, wrap={Block}, collectives=collectives,
                                            prefetch=prefetch)
        return model, torch.optim.AdamW(model.parameters(), **kw), True
    if strategy == "torch_zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(module)
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw), False
    if strategy == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in module:
            fully_shard(b)
        fully_shard(module)
        return module, torch.optim.AdamW(module.parameters(), **kw), False
    raise ValueError(strategy)


def _worker(strategy, width, depth, batch, steps):
    rss0 = _rss_mib()
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    model, opt, ours = _build(strategy, width, depth)
    times = []
    for i in range(steps + 2):  # two warm-up steps
        dist.barrier()
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        if ours:
            model.backward(loss, num_items=batch)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available()
            else _peak_mib() - rss0)
    return times, peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--only", nargs="*", default=STRATEGIES, choices=STRATEGIES + VARIANTS)
    a = ap.parse_args(argv)
    times = {s: [] for s in a.only}
    peaks = {s: [] for s in a.only}
    for r in range(a.rounds):
        order = a.only if r % 2 == 0 else a.only[::-1]  # alternate, and flip the order
        for s in order:
            res = gs.spawn(_worker, a.world, s, a.width, a.depth, a.batch, a.steps)
            times[s] += res[0][0]
            peaks[s].append([p for _, p in res])
            print(f"round {r + 1}/{a.rounds} {s:<12} median "
                  f"{statistics.median(res[0][0]) * 1e3:7.1f} ms", flush=True)
    params = a.depth * (a.width * a.width + a.width)
    print(f"\n{a.depth} x Linear({a.width}) + GELU ({params / 1e6:.1f}M params), AdamW, "
          f"batch {a.batch}/rank, {a.world} ranks, {a.rounds} rounds x {a.steps} steps, "
          f"backend {'nccl' if torch.cuda.is_available() else 'gloo'}")
    med = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    print(f"{'strategy':<13}{'median ms':>10}{'ratio':>20}   peak MiB per rank (max of rounds)")
    for s in a.only:
        base = BASELINE.get(s)
        ratio = f"{med[s] / med[base]:.2f}x {base}" if base in med and base != s else ""
        peak = [max(p[k] for p in peaks[s]) for k in range(a.world)]
        print(f"{s:<13}{med[s]:>10.1f}{ratio:>20}   " + " ".join(f"{p:7.1f}" for p in peak))


if __name__ == "__main__":
    main()
