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

from gradsync.engine.transport import comm
from tests.engine.diloco_helpers import STEPS, STREAM, flat_schedule, host_worker_run, identical
from tests.helpers import SharedSpawn

WORLD, PER_HOST = 4, 2
SCHED = flat_schedule(STEPS, WORLD)


def _busy_main(rank, step):
    """The loop's statistics, while a fragment may be in flight: an all-gather on the
    world group at a rank- and step-dependent moment."""
    time.sleep(0.02 * ((rank + step) % 3))
    out = torch.empty(2 * WORLD, dtype=torch.float64)
    comm.all_gather_single(out, torch.tensor([rank, step], dtype=torch.float64))
    assert out.view(WORLD, 2)[:, 1].tolist() == [step] * WORLD, out


SPAWN = SharedSpawn({"quiet": (host_worker_run, (STREAM, SCHED)),
                     "busy": (host_worker_run, (STREAM, SCHED, PER_HOST, _busy_main))},
                    timeout_s=60)


@pytest.mark.timeout(150)
def test_the_loops_collectives_beside_the_fragment_thread_change_nothing():
    quiet = identical(SPAWN.results("quiet", WORLD), WORLD)
    busy = identical(SPAWN.results("busy", WORLD), WORLD)
    assert all(torch.equal(a, b) for a, b in zip(quiet, busy))
