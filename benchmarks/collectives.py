"""Time reduce-scatter / all-gather against all-reduce of the same bytes (2 ranks, gloo).

Usage: PYTHONPATH=src python benchmarks/collectives.py [MB ...]
The figures decide which collective ZeroOptimizer / FullyShardedDataParallel use per
backend (see engine/zero_comm.py).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.engine import comm


def _time(fn, reps):
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def worker(sizes_mb, reps):
    n_world = dist.get_world_size()
    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20 / 4) // n_world * n_world
        full = torch.randn(n)
        shard = torch.empty(n // n_world)
        cands = {
            "all_reduce": lambda f=full: comm.all_reduce(f),
            "reduce_scatter": lambda f=full, s=shard: comm.reduce_scatter_single(s, f),
            "all_gather": lambda f=full, s=shard: comm.all_gather_single(f, s),
        }
        t = {}
        for _ in range(2):  # alternate the candidates
            for name, fn in cands.items():
                t.setdefault(name, []).append(_time(fn, reps))
        rows.append((mb, {k: min(v) for k, v in t.items()}))
    return rows


if __name__ == "__main__":
    sizes = [float(s) for s in sys.argv[1:]] or [1, 8, 34]
    res = gs.spawn(worker, 2, sizes, 5)[0]
    print(f"{'MB':>6} {'all_reduce ms':>14} {'reduce_scatter ms':>18} {'all_gather ms':>14}")
    for mb, t in res:
        print(f"{mb:>6g} {t['all_reduce']:>14.1f} {t['reduce_scatter']:>18.1f} "
              f"{t['all_gather']:>14.1f}")
