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
from tests.engine.sharded_models import Block, Net
from tests.helpers import (
    SHARDED_TOL,
    ShardOptimizer,
    SharedSpawn,
    dataset,
    dp_train,
    job_table,
    max_gap,
    mlp,
    optimizer_spec,
    reference_train,
    same_tensors,
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
    return {"params": params, "algorithms": sorted(set(filter(None, events)))}


def _zero2():
    x, y = dataset()
    dp = gs.DataParallel(mlp(), bucket_cap_mb=0.0005, first_bucket_mb=0.0002,
                         collectives="hierarchical", topology=HostTopology(ranks_per_host=2))
    cls, kw = optimizer_spec("adamw")
    opt = gs.ZeroOptimizer(dp, cls, stage=2, **kw)
    sharded_train(dp, opt, SCHED, x, y, gs.rank())
    return {"params": [p.detach().clone() for p in dp.module.parameters()],
            "reduce_op": opt.comm.reduce_op}


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
    same = list(state) == list(reloaded) and all(torch.equal(state[k], reloaded[k]) for k in state)
    return {"state": state, "shard_world": model.world, "reloaded_same": same, "files": files}


COLLECTIVES = ("hierarchical", "ring", "tree", "server")
JOBS = job_table(*[(f"dp/{c}", _dp, (c,)) for c in COLLECTIVES],
                 ("zero2", _zero2, ()), ("hsdp", _hsdp, ()))
SPAWN = SharedSpawn(JOBS)


def _results(name):
    return SPAWN.results(name, WORLD)


@pytest.mark.parametrize("collectives", COLLECTIVES)
def test_dataparallel_with_reference_algorithms_matches_one_process(collectives):
    results = _results(f"dp/{collectives}")
    x, y = dataset()
    ref = reference_train(mlp(), "sgd", SCHED, x, y)
    for res in results:
        assert same_tensors(res["params"], results[0]["params"])
        assert res["algorithms"] == [collectives]  # every bucket went through the algorithm
    assert max_gap(results[0]["params"], ref) <= 1e-12


def test_zero2_follows_a_hierarchical_dataparallel():
    results = _results("zero2")
    x, y = dataset()
    ref = reference_train(mlp(), "adamw", SCHED, x, y)
    assert all(r["reduce_op"] == "hierarchical" for r in results)
    assert all(same_tensors(r["params"], results[0]["params"]) for r in results)
    assert max_gap(results[0]["params"], ref) <= SHARDED_TOL["adamw"]


def test_hybrid_sharding_matches_one_process_and_checkpoints_from_one_host():
    results = _results("hsdp")
    x, y = dataset()
    ref_model = Net()
    ref = reference_train(ref_model, "adamw", SAME, x, y)
    state = results[0]["state"]
    assert all(r["shard_world"] == 2 for r in results)  # a host's 2 ranks, not all 4
    names = [n for n, _ in ref_model.named_parameters()]
    assert max_gap([state[n] for n in names], ref) <= SHARDED_TOL["adamw"]
    for r in results[1:]:
        assert list(r["state"]) == list(state)
        assert same_tensors(r["state"].values(), state.values())
    assert all(r["reloaded_same"] is True for r in results)
    assert results[0]["files"] == ["manifest.json", "shard-00000-of-00002.pt",
                                   "shard-00001-of-00002.pt"]
