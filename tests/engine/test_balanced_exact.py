"""Unequal, changing shares of each step's global batch give the even split's model.

Two real gloo ranks; each step's global block is dealt by a ShareBalancer whose
measurements are fed through its own all-gather (``gather``), with busy times
that make rank 1 three times slower per sample and then rank 0 twice as slow
as rank 1, so the split changes at least twice. Every strategy (ddp, zero1-3) trains
float64 with ``backward(loss, num_items=n)`` and is compared with one process
on the whole block of every step (and with the even split on two ranks).
"""

import torch

import gradsync as gs
from gradsync.data.balance import ShareBalancer
from gradsync.engine.strategy.registry import build_strategy
from tests.engine.sharded_models import Net
from tests.helpers import SharedSpawn, dataset, job_table, max_gap, reference_train, sharded_train

STEPS, GB, ACCUM, N = 14, 24, 2, 96
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _blocks():
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3)).tolist() * 4
    return [order[s * GB:(s + 1) * GB] for s in range(STEPS)]


def _per_sample_s(step):
    return (0.001, 0.003) if step <= 6 else (0.004, 0.002)


def _balanced_schedule():
    """schedule[step][rank] = micro-batches; the balancer's counts, one per step."""
    bal = ShareBalancer(2, GB, ACCUM, window=2, every=3, warmup=0, min_gain=0.0)
    rank, schedule, counts = gs.rank(), [], []
    for step, block in enumerate(_blocks(), start=1):
        parts = bal.split(block)
        schedule.append([bal.micro_batches(p) for p in parts])
        counts.append(list(bal.counts))
        mine = len(parts[rank])
        samples, busy = bal.gather(mine, _per_sample_s(step)[rank] * mine)
        bal.observe(step, samples, busy)
    return schedule, counts


def _even_schedule():
    bal = ShareBalancer(2, GB, ACCUM, enabled=False)
    return [[bal.micro_batches(p) for p in bal.split(b)] for b in _blocks()]


def _train(strategy, schedule):
    x, y = dataset(N)
    model, opt = build_strategy(Net(), strategy, "fp32", torch.optim.SGD, bucket_mb=0.0005,
                                lr=0.05, momentum=0.9)
    sharded_train(model, opt, schedule, x, y, gs.rank())
    state = model.full_state_dict() if strategy == "zero3" else dict(model.module.state_dict())
    return {k: v.detach().clone() for k, v in state.items()}


def _run(strategy):
    schedule, counts = _balanced_schedule()
    return {"schedule": schedule, "counts": counts, "balanced": _train(strategy, schedule),
            "even": _train(strategy, _even_schedule())}


SPAWN = SharedSpawn(job_table(*[(s, _run, (s,)) for s in STRATEGIES]), timeout_s=240)


def test_ranks_agree_on_a_split_that_follows_the_slower_rank():
    ranks = SPAWN.results("ddp", 2)
    assert ranks[0]["counts"] == ranks[1]["counts"]
    assert ranks[0]["schedule"] == ranks[1]["schedule"]
    distinct = []
    for c in ranks[0]["counts"]:
        if not distinct or distinct[-1] != c:
            distinct.append(c)
    assert distinct[0] == [12, 12] and len(distinct) >= 3, distinct
    assert distinct[1][0] > distinct[1][1] and distinct[-1][0] < distinct[-1][1], distinct
    for step, block in zip(ranks[0]["schedule"], _blocks()):  # every sample of the block once
        assert sorted(i for rank in step for micro in rank for i in micro) == sorted(block)


def test_every_strategy_equals_one_process_on_the_whole_batch():
    x, y = dataset(N)
    for strategy in STRATEGIES:
        ranks = SPAWN.results(strategy, 2)
        reference = reference_train(Net(), "sgd", ranks[0]["schedule"], x, y)
        for r, res in enumerate(ranks):
            gap = max_gap(list(res["balanced"].values()), reference)
            assert gap <= 1e-12, f"{strategy} rank {r}: {gap:.3g} from the reference"
            gap = max_gap(list(res["balanced"].values()), list(res["even"].values()))
            assert gap <= 1e-12, f"{strategy} rank {r}: {gap:.3g} from the even split"
        for name, p in ranks[0]["balanced"].items():  # replicas bitwise identical
            assert torch.equal(p, ranks[1]["balanced"][name]), f"{strategy}: {name} differs"
