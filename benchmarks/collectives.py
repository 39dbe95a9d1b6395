"""Time each way of reducing to shards and of gathering shards, same bytes, alternating.

Usage: PYTHONPATH=src python benchmarks/collectives.py [--world 2] [--reps 7] [MB ...]

Columns: ``all_reduce`` (then keep a slice), gloo's ``reduce_scatter``, the
``pairwise`` point-to-point reduce-scatter, gloo's ``all_gather``, an all-gather
done as an all-reduce of a zero-filled buffer, and the ``pairwise`` gather: the
candidates ``gradsync.engine.transport.shard_comm.ShardComm`` chooses between per backend
(its docstring quotes these figures). Each cell is the best of 3 alternating
medians of ``--reps`` timed calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.engine.sync.replicas import comm_device
from gradsync.engine.transport.shard_comm import CHOICES, ShardComm

COLUMNS = [("reduce", "all_reduce"), ("reduce", "native"), ("reduce", "pairwise"),
           ("gather", "native"), ("gather", "all_reduce"), ("gather", "pairwise")]
HEADER = ["all_reduce RS", "gloo RS", "pairwise RS", "gloo AG", "all_reduce AG", "pairwise AG"]


def _time(fn, reps):
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def worker(sizes_mb, reps):
    world, rank = dist.get_world_size(), dist.get_rank()
    comms = {c: ShardComm(*CHOICES[c]) for c in ("all_reduce", "native", "pairwise")}
    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20 / 4) // world * world
        full = torch.randn(n, device=comm_device())
        shard = torch.randn(n // world, device=full.device)

        def run(kind, choice, full=full, shard=shard):
            c = comms[choice]
            if kind == "reduce":
                return lambda: c.reduce(full, rank, world, None, tag="bench")[0].wait()
            return lambda: c.gather(full, shard, rank, None, tag="bench").wait()

        t = {col: [] for col in COLUMNS}
        for _ in range(3):
            for col in COLUMNS:
                t[col].append(_time(run(*col), reps))
        rows.append((mb, [min(t[col]) for col in COLUMNS]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=float, default=[1, 4.2, 8, 33.6], help="MB")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    rows = gs.spawn(worker, a.world, a.sizes, a.reps)[0]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(f"{a.world} ranks, backend {backend}, ms (best of 3 alternating medians of {a.reps})")
    print(f"{'MB':>6} " + " ".join(f"{h:>14}" for h in HEADER))
    for mb, times in rows:
        print(f"{mb:>6g} " + " ".join(f"{x:>14.2f}" for x in times))


if __name__ == "__main__":
    main()
