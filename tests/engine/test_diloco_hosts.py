"""DiLoCo with a worker per host, in float64, against single-process references.

The DiLoCo paper's workers are islands of accelerators, synchronous inside and
local-update only across the slow links between them. Here 4 ranks form 2
emulated hosts of 2 (``HostTopology(ranks_per_host=2)``): each host trains one
replica with ``gs.DataParallel`` on its intra-host group (exact mean over the host's
items), and ``DiLoCo(..., topology=...)`` sums the item-weighted pseudo-gradients
with the two-level all-reduce.

Claims: H = 1 with inner SGD and outer SGD lr 1 is synchronous data-parallel SGD on
the global batch (<= 1e-12, uneven items, ranks without data); with H = 4 and the
default Nesterov outer step (and Streaming DiLoCo's fragments, delay and mixing)
the run is the 2-worker algorithm whose worker h sees everything host h's ranks
saw; replicas end bitwise identical on every rank; pseudo-gradients go through the
two-level all-reduce (seen by a comm observer).
"""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.engine.transport.algorithms import HostTopology
from tests.engine.diloco_helpers import (
    DP,
    LR,
    NESTEROV,
    STEPS,
    STREAM,
    TOL,
    flat_schedule,
    host_worker_run,
    identical,
    reference_local,
    reference_sync_sgd,
)
from tests.helpers import SharedSpawn, errors_of, max_gap, mlp

WORLD, PER_HOST = 4, 2
SCHED = flat_schedule(STEPS, WORLD)
HOST_SCHED = [[step[2 * h] + step[2 * h + 1] for h in range(WORLD // PER_HOST)]
              for step in SCHED]
"""What each host saw: its two ranks' items, in rank order."""


def _bad_input():
    top = HostTopology(ranks_per_host=PER_HOST)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return errors_of(not_a_topology=lambda: gs.DiLoCo(model, opt, topology="hosts"),
                     compressed=lambda: gs.DiLoCo(model, opt, topology=top, compress="int8"))


JOBS = {"dp": (host_worker_run, (DP, SCHED)), "nesterov": (host_worker_run, (NESTEROV, SCHED)),
        "stream": (host_worker_run, (STREAM, SCHED)), "bad_input": (_bad_input, ())}


SPAWN = SharedSpawn(JOBS, timeout_s=90)


def _results(name):
    return SPAWN.results(name, WORLD)


def test_h1_per_host_is_synchronous_sgd_on_the_global_batch():
    params = identical(_results("dp"), WORLD)
    assert any(not rank for step in SCHED for rank in step)  # ranks without data
    gap = max_gap(params, reference_sync_sgd(SCHED))
    assert gap <= TOL, f"gap {gap:.3e}"


@pytest.mark.parametrize("name,cfg", [("nesterov", NESTEROV), ("stream", STREAM)])
def test_a_host_is_one_worker_that_saw_its_ranks_items(name, cfg):
    params = identical(_results(name), WORLD)
    fragments = [[0, 1], [2, 3, 4, 5]] if "F" in cfg else None
    gap = max_gap(params, reference_local(HOST_SCHED, STEPS, WORLD // PER_HOST, cfg,
                                          fragments))
    assert gap <= TOL, f"gap {gap:.3e}"


def test_pseudo_gradients_travel_by_the_two_level_all_reduce():
    """One hierarchical all-reduce of the whole pseudo-gradient per sync (its inter-host
    step carries 1/2 of it per rank: ``test_hierarchical.py``), counted as a flat ring's
    2 (N-1)/N of the size."""
    res = _results("nesterov")
    assert len(res) == WORLD
    numel = sum(p.numel() for p in mlp().parameters())
    syncs = res[0]["stats"].syncs
    assert syncs == 4  # steps 4, 8, 12 and sync_now at 14
    for r in res:
        stats, seen = r["stats"], r["inter_host"]
        assert seen["algorithms"] == {"hierarchical"}
        assert seen["bytes"] == syncs * numel * 8
        assert stats.bytes_sent == stats.exact_bytes


def test_bad_topology_arguments_are_one_line_errors():
    errors = _results("bad_input")
    assert len(errors) == WORLD
    for rank in errors:
        assert list(rank) == ["not_a_topology", "compressed"]
        assert "must be a HostTopology" in rank["not_a_topology"]
        assert "no group or compress" in rank["compressed"]
