"""Streaming DiLoCo with a worker per host keeps its background reductions off the
groups the training loop uses.

Its thread sums each fragment's pseudo-gradient over a host topology of its own; the
item count went over the world group instead, from that thread, while the loop's
main thread ran its own collectives on the world group (its per-step statistics):
two threads issuing on one gloo group pair up in whichever order each rank reached
them, and the benchmark's run hung at its last step. Here the main thread runs an
all-gather on the world group after every step, at a rank- and step-dependent moment,
and the run must end with the same parameters as without it, identical on every rank.
"""

from __future__ import annotations

import time

import pytest
import torch

import gradsync as gs
from gradsync.engine.transport import comm
from gradsync.engine.transport.algorithms import HostTopology
from tests.engine.diloco_helpers import LR, STEPS, STREAM, flat_schedule, identical, outer_optimizer
from tests.helpers import SharedSpawn, dataset, mlp, mse

WORLD, PER_HOST = 4, 2
SCHED = flat_schedule(STEPS, WORLD)


def _run(busy_main: bool):
    rank = gs.rank()
    top = HostTopology(ranks_per_host=PER_HOST)
    x, y = dataset()
    model = mlp()
    replica = gs.DataParallel(model, group=top.intra_group)
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    d = gs.StreamingDiLoCo(model, inner, outer_optimizer=outer_optimizer(STREAM["outer"]),
                           sync_every=STREAM["H"], fragments=STREAM["F"], delay=STREAM["tau"],
                           alpha=STREAM["alpha"], topology=top)
    for s in range(STEPS):
        idx = SCHED[s][rank]
        if idx:
            replica.backward(mse(replica(x[idx]), y[idx]), num_items=len(idx))
        else:
            replica.backward(None, num_items=0)
        inner.step()
        inner.zero_grad()
        d.step(num_items=len(idx))
        if busy_main:  # the loop's statistics, while a fragment may be in flight
            time.sleep(0.02 * ((rank + s) % 3))
            out = torch.empty(2 * WORLD, dtype=torch.float64)
            comm.all_gather_single(out, torch.tensor([rank, s], dtype=torch.float64))
            assert out.view(WORLD, 2)[:, 1].tolist() == [s] * WORLD, out
    d.sync_now()
    d.close()
    return {"params": [p.detach().clone() for p in model.parameters()]}


SPAWN = SharedSpawn({"quiet": (_run, (False,)), "busy": (_run, (True,))}, timeout_s=60)


@pytest.mark.timeout(150)
def test_the_loops_collectives_beside_the_fragment_thread_change_nothing():
    quiet = identical(SPAWN.results("quiet", WORLD), WORLD)
    busy = identical(SPAWN.results("busy", WORLD), WORLD)
    assert all(torch.equal(a, b) for a, b in zip(quiet, busy))
