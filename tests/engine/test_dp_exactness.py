"""DataParallel against one process on the whole global batch, in float64.

The claim is exactness: gap to the single process <= 1e-12 and replicas
bitwise identical (max drift across replicas: 0).
"""

import pytest

import gradsync as gs
from tests.helpers import (
    dataset,
    dp_train,
    even_schedule,
    max_gap,
    mlp,
    reference_train,
    same_tensors,
)

STEPS = 20


def _train_both_optimizers(schedule, use_items=True, clip=None, seed_per_rank=True):
    rank = gs.rank()
    x, y = dataset()
    out = {}
    for opt in ("sgd", "adamw"):
        # different seeds per rank: construction must broadcast rank 0's values
        model = mlp(seed=rank if seed_per_rank else 0)
        dp = gs.DataParallel(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
        out[opt] = dp_train(dp, opt, schedule, x, y, rank, use_items=use_items, clip=clip)
        out[opt + "_buckets"] = len(dp.bucket_plan)
    return out


def _check(results, world, schedule, clip=None, tol=1e-12):
    assert len(results) == world
    x, y = dataset()
    for opt in ("sgd", "adamw"):
        ref = reference_train(mlp(seed=0), opt, schedule, x, y, clip=clip)
        r0 = results[0][opt]
        for r, res in enumerate(results[1:], start=1):
            assert same_tensors(r0, res[opt]), f"rank {r} drifted from rank 0 with {opt}"
        gap = max_gap(r0, ref)
        assert gap <= tol, f"{opt}: gap to single process {gap:.3e} > {tol}"
        assert results[0][opt + "_buckets"] > 1  # several buckets really exercised


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_equal_shards_match_single_process(world):
    schedule = even_schedule(STEPS, world, per_rank=24 // world, n=96)
    results = gs.spawn(_train_both_optimizers, world, schedule)
    _check(results, world, schedule)


def _uneven_schedule(world):
    """Uneven shards, several no_sync micro-steps of unequal sizes, a rank with nothing."""
    sched = []
    cursor = 0
    for s in range(STEPS):
        step = []
        for r in range(world):
            sizes = [(s + r) % 4 + 1, 0, 2 * r + 1][: 1 + (s + r) % 3]
            if r == world - 1 and s % 5 == 0:
                sizes = [0]  # this rank holds no items at all this step
            micros = []
            for n in sizes:
                micros.append([(cursor + i) % 96 for i in range(n)])
                cursor += n
            step.append(micros)
        sched.append(step)
    return sched


def test_uneven_items_and_accumulation_are_exact():
    schedule = _uneven_schedule(3)
    results = gs.spawn(_train_both_optimizers, 3, schedule)
    _check(results, 3, schedule, tol=1e-12)


def test_average_of_means_is_off_on_uneven_shards():
    """DDP's convention (plain loss.backward()) is exact only for equal counts."""
    world = 2
    schedule = [[[list(range(0, 30))], [list(range(30, 36))]] for _ in range(5)]
    results = gs.spawn(_train_both_optimizers, world, schedule, False)
    x, y = dataset()
    ref = reference_train(mlp(seed=0), "sgd", schedule, x, y)
    assert max_gap(results[0]["sgd"], ref) > 1e-4
    exact = gs.spawn(_train_both_optimizers, world, schedule, True)
    assert max_gap(exact[0]["sgd"], ref) <= 1e-12


def test_clip_grad_norm_after_backward_matches_reference():
    schedule = even_schedule(8, 2, per_rank=12, n=96)
    results = gs.spawn(_train_both_optimizers, 2, schedule, True, 0.05)
    _check(results, 2, schedule, clip=0.05)
