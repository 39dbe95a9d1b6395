"""The worker of benchmarks/collectives_netlab.py: runs under torchrun on an emulated host.

    collectives_netlab_worker.py OUT.json '[[[ALGO, NBYTES], ...], LINK_SIZES, REPS]'

First times the intra- and inter-host links (``gradsync.calibrate.links``), then
every (algorithm, size) point: a barrier, one all-reduce (messages under 1 MB
repeated up to 8 times and averaged), ``reps`` times. Rank 0 writes the links and,
per point, the median over repetitions of the slowest rank's time to OUT.json.
Every all-reduce of ones is checked to sum to the world size (exact in float32),
so a wrong algorithm cannot post a time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

ALGOS = ("ring", "tree", "server", "hierarchical")


def worker(points: list[tuple[str, int]], link_sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import gradsync as gs
    from gradsync.calibrate.links import measure_worker
    from gradsync.engine.transport import comm
    from gradsync.engine.transport.algorithms import ALGORITHMS, HostTopology, hierarchical

    torch.set_num_threads(1)
    gs.init()
    links = measure_worker(link_sizes, reps)
    top = HostTopology.from_env()
    world = top.world_size
    run = dict(ALGORITHMS, hierarchical=lambda t: hierarchical.all_reduce_(t, top))
    mine = []
    for algo, nbytes in points:
        t = torch.ones(nbytes // 4)
        run[algo](t)  # the check: a sum of ones is exact in float32
        if not (t.min().item() == t.max().item() == world):
            raise AssertionError(f"{algo} at {nbytes} B: wrong sum")
        inner = max(1, min(8, (1 << 20) // nbytes))
        for _ in range(inner):  # warm-up: fresh connections start slow (TCP slow start)
            t.fill_(1.0)
            run[algo](t)
        for _ in range(reps):
            t.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                run[algo](t)
            mine.append((time.perf_counter() - t0) / inner)
    flat = torch.tensor(mine, dtype=torch.float64)
    table = torch.empty(world * flat.numel(), dtype=torch.float64)
    comm.all_gather_single(table, flat, tag="bench")
    if dist.get_rank() == 0:
        slowest = table.view(world, -1).max(dim=0).values.view(len(points), reps)
        medians = [statistics.median(row) for row in slowest.tolist()]
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"links": links, "points": [[a, n, m] for (a, n), m in
                                                   zip(points, medians)]}, f)
    top.close()
    gs.shutdown()


if __name__ == "__main__":
    _points, _link_sizes, _reps = json.loads(sys.argv[2])
    worker([tuple(p) for p in _points], _link_sizes, _reps, sys.argv[1])
