"""ZeroOptimizer stages 1 and 2 against one process on the whole global batch, in float64.

Claims: after 20 steps the gap is <= 1e-12 with SGD-momentum and <= 1e-9 with AdamW,
for K = 2 and 3 (uneven shards with padding), with no_sync accumulation and uneven
num_items; replicas are bitwise identical; what is not a shardable setting is refused.
Collectives per step, bf16 memory, state_dict and gradient clearing:
``test_zero_steps.py``.
"""

import pytest
import torch

import gradsync as gs
from tests.helpers import (
    SHARDED_STEPS,
    SHARDED_TOL,
    SharedSpawn,
    Tied,
    Tiny,
    dataset,
    job_table,
    max_gap,
    mlp,
    optimizer_spec,
    reference_train,
    same_tensors,
    sharded_train,
    uneven_schedule,
)

STEPS = SHARDED_STEPS
TOL = SHARDED_TOL


def _zero(factory, stage, kind, schedule, collectives="auto", clip=None):
    x, y = dataset()
    dp = gs.DataParallel(factory(), bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
    cls, kw = optimizer_spec(kind)
    opt = gs.ZeroOptimizer(dp, cls, stage=stage, collectives=collectives, **kw)
    sharded_train(dp, opt, schedule, x, y, gs.rank(), clip=clip)
    return {"params": [p.detach().clone() for p in dp.module.parameters()],
            "shards": len(opt.shards)}


def _run_both(factory, stage, schedule, collectives="auto", clip=None):
    return {k: _zero(factory, stage, k, schedule, collectives, clip) for k in ("sgd", "adamw")}


def _check(results, world, factory, schedule, clip=None):
    assert len(results) == world
    x, y = dataset()
    for kind in ("sgd", "adamw"):
        ref = reference_train(factory(), kind, schedule, x, y, clip=clip)
        r0 = results[0][kind]["params"]
        for r, res in enumerate(results[1:], start=1):
            assert same_tensors(r0, res[kind]["params"]), f"rank {r} drifted"
        gap = max_gap(r0, ref)
        assert gap <= TOL[kind], f"{kind}: gap {gap:.3e}"


SCHED = {2: uneven_schedule(STEPS, 2), 3: uneven_schedule(STEPS, 3)}
# "auto" is the pairwise exchange on gloo; every algorithm is checked at K = 2 or 3
EXACT = [(1, 2, "auto"), (2, 2, "native"), (1, 3, "native"), (2, 3, "auto"),
         (1, 3, "all_reduce")]


def _exact_name(stage, world, collectives):
    return f"mlp/stage{stage}/world{world}/{collectives}"


def _jobs(world):
    """Everything this module runs on ``world`` workers, in one spawn (tests stay fast)."""
    entries = [(_exact_name(st, w, c), _run_both, (mlp, st, SCHED[w], c))
               for st, w, c in EXACT if w == world]
    if world == 2:
        entries.append(("tied/stage2", _run_both, (Tied, 2, SCHED[2])))
    else:
        entries.append(("tiny/stage1/clip", _run_both, (Tiny, 1, SCHED[3], "auto", 0.05)))
    return job_table(*entries)


SPAWN = SharedSpawn(_jobs)


def _results(world, name):
    return SPAWN.results(name, world)


@pytest.mark.parametrize("stage,world,collectives", EXACT)
def test_zero_matches_single_process_with_uneven_items(stage, world, collectives):
    results = _results(world, _exact_name(stage, world, collectives))
    assert results[0]["sgd"]["shards"] > 1  # several buckets, each sharded with padding
    _check(results, world, mlp, SCHED[world])


def test_zero2_tied_weights_exact():
    _check(_results(2, "tied/stage2"), 2, Tied, SCHED[2])


def test_zero_fewer_elements_than_ranks_and_clipping():
    _check(_results(3, "tiny/stage1/clip"), 3, Tiny, SCHED[3], clip=0.05)


def _bad_input():
    dp = gs.DataParallel(mlp())
    errors = {}
    for stage in (0, 3, 4, True):
        try:
            gs.ZeroOptimizer(dp, torch.optim.SGD, stage=stage, lr=0.1)
            errors[f"stage={stage}"] = None
        except gs.UsageError as e:
            errors[f"stage={stage}"] = str(e)
    try:
        gs.ZeroOptimizer(dp, torch.optim.LBFGS, stage=1)
        errors["LBFGS"] = None
    except gs.UsageError as e:
        errors["LBFGS"] = str(e)
    return errors


def test_bad_stage_and_whole_tensor_optimizer_rejected():
    (errors,) = gs.spawn(_bad_input, 1)
    assert list(errors) == ["stage=0", "stage=3", "stage=4", "stage=True", "LBFGS"]
    assert all(isinstance(m, str) for m in errors.values()), errors  # every one refused
    assert "stage must be 1 or 2" in errors["stage=0"]
    assert "FullyShardedDataParallel" in errors["stage=3"]
    assert "LBFGS cannot run on shards" in errors["LBFGS"] and "AdamW" in errors["LBFGS"]
