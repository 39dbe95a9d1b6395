"""DiLoCo, Local SGD and Streaming DiLoCo against single-process simulations, in float64.

Claims: with H = 1, inner SGD and an outer SGD of lr 1, DiLoCo is synchronous
data-parallel SGD on the global batch (<= 1e-12, uneven items, a worker with none);
Local SGD (outer lr 1, no momentum) is parameter averaging, and DiLoCo's default
Nesterov outer step is the item-weighted outer step of a K-worker simulation;
Streaming DiLoCo (F fragments, delay tau, merge alpha) matches a simulation of the
paper's schedule and equals DiLoCo bit for bit when F = 1, tau = 0, alpha = 0; an outer
optimizer built over the model is rebuilt over the global copy; replicas end bitwise
identical. Checkpoints, compression, bytes, buffers and bad input:
``test_diloco_state.py``; a worker per host: ``test_diloco_hosts.py``.
"""

from __future__ import annotations

import pytest

from gradsync.engine.local.exchange import split_parameters
from tests.engine.diloco_helpers import (
    DP,
    EVEN,
    INSTANCE,
    LOCAL,
    NESTEROV,
    SCHED,
    STEPS,
    STREAM,
    STREAM_AS_DILOCO,
    TOL,
    identical,
    reference_local,
    reference_sync_sgd,
    run_diloco,
)
from tests.helpers import SharedSpawn, max_gap, mlp, same_tensors


def _jobs(world):
    sched = SCHED[world]
    jobs = {"dp": (run_diloco, (DP, sched, STEPS)),
            "local": (run_diloco, (LOCAL, EVEN[world], STEPS)),
            "nesterov": (run_diloco, (NESTEROV, sched, STEPS)),
            "stream": (run_diloco, (STREAM, sched, STEPS))}
    if world == 2:
        jobs["stream_as_diloco"] = (run_diloco, (STREAM_AS_DILOCO, sched, STEPS))
        jobs["instance"] = (run_diloco, (INSTANCE, sched, STEPS))
    return jobs


SPAWN = SharedSpawn(_jobs, timeout_s=60)


def _results(world, name):
    return SPAWN.results(name, world)


@pytest.mark.parametrize("world", [2, 3])
def test_h1_is_synchronous_data_parallel_sgd_with_uneven_items(world):
    params = identical(_results(world, "dp"), world)
    assert any(not rank for step in SCHED[world] for rank in step)  # a worker with nothing
    gap = max_gap(params, reference_sync_sgd(SCHED[world]))
    assert gap <= TOL, f"gap {gap:.3e}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name,cfg,even", [("local", LOCAL, True), ("nesterov", NESTEROV, False)])
def test_outer_step_matches_a_k_worker_simulation(world, name, cfg, even):
    """local: Local SGD = plain averaging (equal items); nesterov: item-weighted."""
    sched = (EVEN if even else SCHED)[world]
    params = identical(_results(world, name), world)
    gap = max_gap(params, reference_local(sched, STEPS, world, cfg))
    assert gap <= TOL, f"gap {gap:.3e}"


@pytest.mark.parametrize("world", [2, 3])
def test_streaming_matches_the_papers_schedule(world):
    params = identical(_results(world, "stream"), world)
    frags = [[0, 1], [2, 3, 4, 5]]  # mlp(): 6 tensors, 84 + 156 + 39 elements, cut at half
    model = mlp()
    assert [[n for n, _ in f] for f in split_parameters(model, 2)] == \
        [[list(dict(model.named_parameters()))[j] for j in f] for f in frags]
    gap = max_gap(params, reference_local(SCHED[world], STEPS, world, STREAM, frags))
    assert gap <= TOL, f"gap {gap:.3e}"


def test_streaming_with_one_fragment_no_delay_no_mixing_is_diloco():
    streaming = identical(_results(2, "stream_as_diloco"), 2)
    diloco = identical(_results(2, "nesterov"), 2)
    assert same_tensors(streaming, diloco)


def test_outer_optimizer_built_over_the_model_is_rebuilt_over_the_global_copy():
    """torchft's convention: ``outer = SGD(model.parameters(), ...)``; the same run as the
    factory ``lambda ps: SGD(ps, ...)`` with those options."""
    sched = SCHED[2]
    params = identical(_results(2, "instance"), 2)
    gap = max_gap(params, reference_local(sched, STEPS, 2, {"H": 4, "outer": "momentum"}))
    assert gap <= TOL, f"gap {gap:.3e}"
