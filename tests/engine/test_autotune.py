"""bucket_cap_mb="auto": measured choice, same on every rank, and still exact."""

import pytest

import gradsync as gs
from gradsync.engine.buckets.autotune import BucketAutotuner, candidate_caps_mb
from tests.helpers import (
    dataset,
    dp_train,
    even_schedule,
    max_gap,
    mlp,
    reference_train,
    same_tensors,
)


def test_candidates_double_up_to_one_bucket():
    caps = candidate_caps_mb(3 * 1024 * 1024)
    assert caps == [0.25, 0.5, 1.0, 2.0, 3.0]
    many = candidate_caps_mb(10 * 1024**3)
    assert len(many) == 10 and many[0] == 0.25 and many[-1] == 10 * 1024


def test_tuner_walks_candidates_then_decides():
    t = BucketAutotuner(2 * 1024 * 1024, measure=2, warmup=1)
    assert t.result.candidates_mb == [0.25, 0.5, 1.0, 2.0]
    actions = [t.record(0.1) for _ in range(4 * 3)]
    assert actions.count("next") == 3 and actions[-1] == "decide"
    assert t.decide([0.3, 0.1, 0.2, 0.4]) == 0.5 and t.done and t.current_mb == 0.5


def test_bad_bucket_cap_rejected():
    with pytest.raises(ValueError):
        BucketAutotuner(10, measure=0)


def _auto():
    x, y = dataset()
    dp = gs.DataParallel(mlp(seed=0, hidden=256, depth=4), bucket_cap_mb="auto")
    params = dp_train(dp, "sgd", even_schedule(30, 2, 12, 96), x, y, gs.rank())
    res = dp.autotune_result
    return {"params": params, "chosen_mb": res.chosen_mb, "candidates_mb": res.candidates_mb,
            "median_s": res.median_s, "cap_bytes": dp.bucket_cap_bytes}


def test_auto_bucket_cap_is_measured_agreed_and_exact():
    results = gs.spawn(_auto, 2)
    r0, r1 = results
    chosen, candidates, medians = r0["chosen_mb"], r0["candidates_mb"], r0["median_s"]
    assert chosen is not None and chosen == r1["chosen_mb"] and chosen in candidates
    assert len(candidates) > 1 and candidates == r1["candidates_mb"]
    assert len(medians) == len(candidates) and all(m > 0 for m in medians)  # all measured
    assert r0["cap_bytes"] == r1["cap_bytes"] == max(1, int(chosen * 1024 * 1024))
    p0 = r0["params"]
    assert same_tensors(p0, r1["params"])
    x, y = dataset()
    sched = even_schedule(30, 2, 12, 96)
    ref = reference_train(mlp(seed=0, hidden=256, depth=4), "sgd", sched, x, y)
    assert max_gap(p0, ref) <= 1e-12
