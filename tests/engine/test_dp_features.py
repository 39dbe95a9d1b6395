"""DataParallel features: tied, frozen and unused parameters, bucket order, hooks, checkpointing.

Each trains as one process on the whole batch (<= 1e-12, replicas bitwise identical);
collectives: none under no_sync, one per bucket, launched during the backward, into
buckets that ``.grad`` views. What DataParallel refuses: ``test_dp_errors.py``.
"""

import torch

import gradsync as gs
from gradsync.engine.transport import comm
from tests.engine.dp_models import (
    SCHED,
    Shuffled,
    ckpt_factory,
    frozen_factory,
    reordered_factory,
    run_dp,
    unused_factory,
)
from tests.helpers import (
    Tied,
    dataset,
    dp_train,
    even_schedule,
    max_gap,
    mse,
    reference_train,
    same_tensors,
)


def _assert_exact(results, world, factory, schedule=SCHED, opt="sgd"):
    assert len(results) == world
    x, y = dataset()
    ref = reference_train(factory(), opt, schedule, x, y)
    for r, res in enumerate(results[1:], start=1):
        assert same_tensors(results[0]["params"], res["params"]), f"rank {r} drifted"
    assert max_gap(results[0]["params"], ref) <= 1e-12


def test_tied_weights_synchronised_once():
    results = gs.spawn(run_dp, 2, Tied, SCHED)
    _assert_exact(results, 2, Tied)
    plan, names = results[0]["plan"], results[0]["names"]
    assert sum(len(b.params) for b in plan) == len(names) == 5
    assert any(" = " in n for n in names)  # the shared weight is listed under both names


def test_frozen_parameters_never_communicated_nor_changed():
    results = gs.spawn(run_dp, 2, frozen_factory, SCHED)
    _assert_exact(results, 2, frozen_factory)
    assert not any(n.startswith("b.") for n in results[0]["names"])
    start = frozen_factory()
    names = [n for n, _ in start.named_parameters()]
    trained = dict(zip(names, results[0]["params"], strict=True))
    assert torch.equal(trained["b.weight"], start.b.weight)
    assert torch.equal(trained["b.bias"], start.b.bias)
    assert not torch.equal(trained["a.weight"], start.a.weight)  # the rest trained


def test_use_order_differs_from_registration_tiny_buckets():
    results = gs.spawn(run_dp, 3, reordered_factory, even_schedule(6, 3, 8, 96))
    _assert_exact(results, 3, reordered_factory, even_schedule(6, 3, 8, 96))
    plan, names = results[0]["plan"], results[0]["names"]
    # rebuilt in the order gradients became ready: head first, inp last
    first = names[plan[0].params[0]]
    last = names[plan[-1].params[-1]]
    assert first.startswith("head.") and last.startswith("inp."), (first, last)
    assert len(plan) >= 10


def test_activation_checkpointing_non_reentrant():
    results = gs.spawn(run_dp, 2, ckpt_factory, SCHED, "adamw")
    _assert_exact(results, 2, ckpt_factory, opt="adamw")


def test_unused_parameters_with_find_unused_true_count_as_zero():
    results = gs.spawn(run_dp, 2, unused_factory, SCHED, "sgd", True)
    _assert_exact(results, 2, unused_factory)


def _count_collectives(accum):
    x, y = dataset()
    dp = gs.DataParallel(Shuffled(), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    per_step = []
    for _ in range(3):
        events: list = []

        def record(kind, ev, events=events):
            if kind == "launch":
                events.append(ev.tag)

        with comm.add_observer(record):
            for k in range(accum):
                idx = list(range(k * 4, k * 4 + 4))
                if k < accum - 1:
                    with dp.no_sync():
                        dp.backward(mse(dp(x[idx]), y[idx]), num_items=4)
                    assert events == [], f"collective under no_sync: {events}"
                else:
                    dp.backward(mse(dp(x[idx]), y[idx]), num_items=4)
        opt.step()
        opt.zero_grad()
        per_step.append(events)
    return {"per_step": per_step, "buckets": len(dp.bucket_plan)}


def test_collective_count_none_under_no_sync_one_per_bucket():
    res = gs.spawn(_count_collectives, 2, 3)[0]
    per_step, n_buckets = res["per_step"], res["buckets"]
    assert n_buckets >= 3 and len(per_step) == 3
    # step 0 also carries the one-off broadcast of the observed gradient order
    assert per_step[0].count("rebuild") == 1
    for events in per_step[1:]:
        buckets = [t for t in events if t.startswith("bucket")]
        assert buckets == [f"bucket{i}" for i in range(n_buckets)]
        # the item count rides in the first bucket: nothing but the buckets travels
        assert events.count("header") == 0 and len(events) == n_buckets


def _hooks_left(model):
    return sum(
        len(p._post_accumulate_grad_hooks or {})
        for p in model.parameters()
        if getattr(p, "_post_accumulate_grad_hooks", None) is not None
    )


def _wrap_unwrap_rewrap():
    model = Shuffled()
    x, y = dataset()
    before = _hooks_left(model)
    dp = gs.DataParallel(model)
    during = _hooks_left(model)
    dp.backward(mse(dp(x[:8]), y[:8]), num_items=8)
    module = dp.unwrap()
    after = _hooks_left(module)
    module.zero_grad()
    dp2 = gs.DataParallel(module)
    params = dp_train(dp2, "sgd", SCHED, x, y, gs.rank())
    return {"hooks": {"before": before, "wrapped": during, "unwrapped": after,
                      "rewrapped": _hooks_left(module)},
            "params": params, "keys": list(dp2.state_dict())}


def test_hooks_removed_on_unwrap_and_rewrap_works():
    results = gs.spawn(_wrap_unwrap_rewrap, 2)
    n_params = len(list(Shuffled().parameters()))
    for res in results:
        assert res["hooks"] == {"before": 0, "wrapped": n_params, "unwrapped": 0,
                                "rewrapped": n_params}
        assert res["keys"] == list(Shuffled().state_dict())  # no "module." prefix
    assert same_tensors(results[0]["params"], results[1]["params"])  # the rewrap synchronises


def _overlap_and_views():
    x, y = dataset()
    dp = gs.DataParallel(Shuffled(), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    dp.backward(mse(dp(x[:8]), y[:8]), num_items=8)  # first step: rebuild in ready order
    timeline = []
    last = dp.module.inp.weight  # input layer: its gradient is the last to arrive
    last.register_post_accumulate_grad_hook(lambda p: timeline.append("input layer ready"))

    def record(kind, ev):
        if kind == "launch" and ev.tag.startswith("bucket"):
            timeline.append(ev.tag)

    with comm.add_observer(record):
        dp.backward(mse(dp(x[8:16]), y[8:16]), num_items=8)
    buffers = [b.buffer for b in dp.buckets]
    views = all(
        any(p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            for buf in buffers)
        for p in dp.parameters() if p.requires_grad)
    return {"timeline": timeline, "grads_are_views": views}


def test_buckets_launch_during_backward_and_grads_are_bucket_views():
    res = gs.spawn(_overlap_and_views, 2)[0]
    assert res["grads_are_views"] is True, "param.grad must be a view into a bucket buffer"
    timeline = res["timeline"]
    ready = timeline.index("input layer ready")
    launched_before = [t for t in timeline[:ready] if t.startswith("bucket")]
    assert len(launched_before) >= 2, timeline  # communication started mid-backward
