"""Two-level (hierarchical) reductions inside the strategies, against one process in float64.

Four ranks emulate two hosts of two (``HostTopology(ranks_per_host=2)``), so the
intra- and inter-host groups are real process groups without needing network
namespaces (the netlab tests run the same code across emulated links).
DataParallel with ``collectives="hierarchical"`` (and the flat reference
algorithms), ZeRO-2 following it, and stage 3's hybrid mode (HSDP: shard inside
a host, replicate across hosts) must give the one-process trajectory on uneven
items with ``no_sync``, bitwise identical on every rank.
"""

import os
import tempfile

import pytest
import torch

import gradsync as gs
from gradsync.engine.sharded.checkpoint import load_sharded, save_sharded
from gradsync.engine.transport import comm
from gradsync.engine.transport.algorithms import HostTopology
from tests.engine.test_fsdp import Block, Net
from tests.helpers import (
    SHARDED_TOL,
    ShardOptimizer,
    dataset,
    dp_train,
    job_results,
    max_gap,
    mlp,
    optimizer_spec,
    reference_train,
    run_jobs,
    sharded_train,
    uneven_schedule,
)

WORLD, STEPS = 4, 6
SCHED = uneven_schedule(STEPS, WORLD)
SAME = uneven_schedule(STEPS, WORLD, same_micro_steps=True)


def _dp(collectives):
    x, y = dataset()
    topo = HostTopology(ranks_per_host=2) if collectives == "hierarchical" else None
    dp = gs.DataParallel(mlp(), bucket_cap_mb=0.0005, first_bucket_mb=0.0002,
                         collectives=collectives, topology=topo)
    events = []
    with comm.add_observer(lambda k, ev: events.append(ev.meta.get("algorithm"))
                           if k == "launch" and ev.tag.startswith("bucket") else None):
        params = dp_train(dp, "sgd", SCHED, x, y, gs.rank())
    return params, sorted(set(filter(None, events)))


def _zero2():
    x, y = dataset()
    dp = gs.DataParallel(mlp(), bucket_cap_mb=0.0005, first_bucket_mb=0.0002,
                         collectives="hierarchical", topology=HostTopology(ranks_per_host=2))
    cls, kw = optimizer_spec("adamw")
    opt = gs.ZeroOptimizer(dp, cls, stage=2, **kw)
    sharded_train(dp, opt, SCHED, x, y, gs.rank())
    return [p.detach().clone() for p in dp.module.parameters()], opt.comm.reduce_op


def _hsdp():
    x, y = dataset()
    model = gs.FullyShardedDataParallel(Net(), wrap={Block},
                                        hybrid=HostTopology(ranks_per_host=2))
    cls, kw = optimizer_spec("adamw")
    opt = cls(model.parameters(), **kw)

    sharded_train(model, ShardOptimizer(model, opt), SAME, x, y, gs.rank())
    state = model.full_state_dict()
    # a checkpoint written by host 0 alone loads back on every host
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt") if gs.rank() == 0 else None
        box = [path]
        torch.distributed.broadcast_object_list(box, 0)
        save_sharded(box[0], model, opt)
        files = sorted(os.listdir(box[0])) if gs.rank() == 0 else None
        fresh = gs.FullyShardedDataParallel(Net(seed=1), wrap={Block},
                                            hybrid=HostTopology(ranks_per_host=2))
        fresh_opt = cls(fresh.parameters(), **kw)
        load_sharded(box[0], fresh, fresh_opt)
        reloaded = fresh.full_state_dict()
        torch.distributed.barrier()
    same = all(torch.equal(state[k], reloaded[k]) for k in state)
    return state, model.world, same, files


def _jobs():
    return ([(_dp, (c,)) for c in ("hierarchical", "ring", "tree", "server")]
            + [(_zero2, ()), (_hsdp, ())])


_cache: dict = {}


def _results(index):
    if "r" not in _cache:
        _cache["r"] = gs.spawn(run_jobs, WORLD, _jobs())
    return job_results(_cache["r"], index)


@pytest.mark.parametrize("index,collectives", [(0, "hierarchical"), (1, "ring"), (2, "tree"),
                                               (3, "server")])
def test_dataparallel_with_reference_algorithms_matches_one_process(index, collectives):
    results = _results(index)
    x, y = dataset()
    ref = reference_train(mlp(), "sgd", SCHED, x, y)
    for params, algorithms in results:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
        assert algorithms == [collectives]  # every bucket went through the algorithm
    assert max_gap(results[0][0], ref) <= 1e-12


def test_zero2_follows_a_hierarchical_dataparallel():
    results = _results(4)
    x, y = dataset()
    ref = reference_train(mlp(), "adamw", SCHED, x, y)
    assert results[0][1] == "hierarchical"
    assert all(torch.equal(a, b) for r in results for a, b in zip(r[0], results[0][0]))
    assert max_gap(results[0][0], ref) <= SHARDED_TOL["adamw"]


def test_hybrid_sharding_matches_one_process_and_checkpoints_from_one_host():
    results = _results(5)
    x, y = dataset()
    ref_model = Net()
    ref = reference_train(ref_model, "adamw", SAME, x, y)
    state, shard_world, reloaded_same, files = results[0]
    assert shard_world == 2  # sharded over a host's 2 ranks, not all 4
    names = [n for n, _ in ref_model.named_parameters()]
    assert max_gap([state[n] for n in names], ref) <= SHARDED_TOL["adamw"]
    for r in results[1:]:
        assert all(torch.equal(state[k], r[0][k]) for k in state)
    assert all(r[2] for r in results)
    assert files == ["manifest.json", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
