"""DataParallel features: tied, frozen and unused parameters, bucket order, hooks, checkpointing."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradsync as gs
from gradsync.engine.transport import comm
from tests.helpers import (
    D_IN,
    D_OUT,
    Tied,
    dataset,
    dp_train,
    even_schedule,
    max_gap,
    mse,
    reference_train,
)


class Shuffled(nn.Module):
    """Layers used in a different order than they were registered."""

    def __init__(self, frozen=False, unused=False, ckpt=False):
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Linear(8, 8)
        self.head = nn.Linear(8, D_OUT)
        self.b = nn.Linear(8, 8)
        self.inp = nn.Linear(D_IN, 8)
        self.c = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.unused, self.ckpt = unused, ckpt
        if frozen:
            self.b.requires_grad_(False)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.c(h))
        if self.ckpt:
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=False)
        else:
            h = torch.tanh(self.b(h))
        h = torch.tanh(self.a(h))
        if not self.unused:
            h = h + 0.1 * torch.tanh(self.spare(h))
        return self.head(h)


def _run(factory, schedule, opt="sgd", find_unused=False, cap=0.0002):
    x, y = dataset()
    dp = gs.DataParallel(
        factory(), bucket_cap_mb=cap, first_bucket_mb=cap, find_unused_parameters=find_unused
    )
    params = dp_train(dp, opt, schedule, x, y, gs.rank())
    return params, dp.bucket_plan, [s.name for s in dp.param_specs]


SCHED = even_schedule(6, 2, per_rank=12, n=96)


def _assert_exact(results, factory, schedule=SCHED, opt="sgd"):
    x, y = dataset()
    ref = reference_train(factory(), opt, schedule, x, y)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert max_gap(results[0][0], ref) <= 1e-12


def test_tied_weights_synchronised_once():
    results = gs.spawn(_run, 2, Tied, SCHED)
    _assert_exact(results, Tied)
    plan, names = results[0][1], results[0][2]
    assert sum(len(b.params) for b in plan) == len(names) == 5
    assert any(" = " in n for n in names)  # the shared weight is listed under both names


def frozen_factory():
    return Shuffled(frozen=True)


def test_frozen_parameters_never_communicated_nor_changed():
    results = gs.spawn(_run, 2, frozen_factory, SCHED)
    _assert_exact(results, frozen_factory)
    assert not any(n.startswith("b.") for n in results[0][2])
    start = frozen_factory()
    assert torch.equal(results[0][0][4], start.b.weight)  # params() order: a, head, b ...


def reordered_factory():
    return Shuffled()


def test_use_order_differs_from_registration_tiny_buckets():
    results = gs.spawn(_run, 3, reordered_factory, even_schedule(6, 3, 8, 96))
    _assert_exact(results, reordered_factory, even_schedule(6, 3, 8, 96))
    plan, names = results[0][1], results[0][2]
    # rebuilt in the order gradients became ready: head first, inp last
    first = names[plan[0].params[0]]
    last = names[plan[-1].params[-1]]
    assert first.startswith("head.") and last.startswith("inp."), (first, last)
    assert len(plan) >= 10


def ckpt_factory():
    return Shuffled(ckpt=True)


def test_activation_checkpointing_non_reentrant():
    results = gs.spawn(_run, 2, ckpt_factory, SCHED, "adamw")
    _assert_exact(results, ckpt_factory, opt="adamw")


def unused_factory():
    return Shuffled(unused=True)


def test_unused_parameters_with_find_unused_true_count_as_zero():
    results = gs.spawn(_run, 2, unused_factory, SCHED, "sgd", True)
    _assert_exact(results, unused_factory)


def _unused_error():
    try:
        _run(unused_factory, SCHED)
    except gs.UnusedParametersError as e:
        return str(e)
    return None


def test_unused_parameters_error_names_them_on_every_rank():
    messages = gs.spawn(_unused_error, 2)
    for r, msg in enumerate(messages):
        assert msg is not None, f"rank {r} raised nothing"
        assert "'spare.weight'" in msg and "'spare.bias'" in msg
        assert "find_unused_parameters=True" in msg


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
    return per_step, len(dp.bucket_plan)


def test_collective_count_none_under_no_sync_one_per_bucket():
    results = gs.spawn(_count_collectives, 2, 3)
    per_step, n_buckets = results[0]
    assert n_buckets >= 3
    # step 0 also carries the one-off broadcast of the observed gradient order
    assert per_step[0].count("rebuild") == 1
    for events in per_step[1:]:
        buckets = [t for t in events if t.startswith("bucket")]
        assert buckets == [f"bucket{i}" for i in range(n_buckets)]
        # the item count rides in the first bucket: nothing but the buckets travels
        assert events.count("header") == 0 and len(events) == n_buckets


def _mismatch():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2 + gs.rank()))
    try:
        gs.DataParallel(model)
    except gs.ReplicaMismatchError as e:
        return str(e)
    return None


def test_mismatched_models_error_on_every_rank():
    messages = gs.spawn(_mismatch, 3)
    assert all(m == messages[0] for m in messages) and messages[0] is not None
    assert "'1.weight'" in messages[0]
    assert "ranks 0, 1, 2" in messages[0]
    assert "(2, 8)" in messages[0] and "(3, 8)" in messages[0]


def _lazy(wrapper: str):
    """A lazy module wrapped before its dummy forward: on every rank (a usage error), and
    on rank 1 only (a mismatch naming the uninitialized entry, not a hang)."""
    wrap = getattr(gs, wrapper)
    out = []
    for initialized_on in ((), (0,)):
        torch.manual_seed(0)
        module = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 1))
        if gs.rank() in initialized_on:
            module(torch.zeros(2, 5))
        try:
            wrap(module)
            out.append(None)
        except (gs.UsageError, gs.ReplicaMismatchError) as e:
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.parametrize("wrapper", ["DataParallel", "FullyShardedDataParallel"])
def test_uninitialized_lazy_module_is_refused_on_every_rank(wrapper):
    for everywhere, one_rank in gs.spawn(_lazy, 2, wrapper, timeout_s=60):
        assert everywhere[0] == "UsageError", everywhere
        assert "'0.weight', '0.bias'" in everywhere[1] and "forward pass" in everywhere[1]
        assert one_rank[0] == "ReplicaMismatchError", one_rank
        assert "shape (3, 5)" in one_rank[1] and "shape uninitialized" in one_rank[1]


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
    return before, during, after, _hooks_left(module), params, list(dp2.state_dict())


def test_hooks_removed_on_unwrap_and_rewrap_works():
    results = gs.spawn(_wrap_unwrap_rewrap, 2)
    before, during, after, again, params, keys = results[0]
    n_params = len(list(Shuffled().parameters()))
    assert (before, during, after, again) == (0, n_params, 0, n_params)
    assert not any(k.startswith("module.") for k in keys)


def _mixed_modes():
    x, y = dataset()
    dp = gs.DataParallel(Shuffled())
    try:
        with dp.no_sync():
            dp.backward(mse(dp(x[:4]), y[:4]), num_items=4)
        mse(dp(x[4:8]), y[4:8]).backward()
    except gs.UsageError as e:
        return str(e)
    return None


def test_mixing_num_items_and_plain_backward_is_an_error():
    messages = gs.spawn(_mixed_modes, 2)
    assert all(m and "mixed" in m for m in messages)


@pytest.mark.parametrize("bad", [-1, float("nan"), "three", 2.5])
def test_bad_num_items_rejected(bad):
    from gradsync.engine.sync.core import as_count as _as_count

    with pytest.raises(gs.UsageError, match="num_items"):
        _as_count(bad)


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
    return timeline, views


def test_buckets_launch_during_backward_and_grads_are_bucket_views():
    timeline, views = gs.spawn(_overlap_and_views, 2)[0]
    assert views, "param.grad must be a view into a bucket buffer"
    ready = timeline.index("input layer ready")
    launched_before = [t for t in timeline[:ready] if t.startswith("bucket")]
    assert len(launched_before) >= 2, timeline  # communication started mid-backward


def _mixed_across_ranks_in_a_later_window(wrapper):
    x, y = dataset()
    model = (gs.DataParallel(Shuffled()) if wrapper == "dp"
             else gs.FullyShardedDataParallel(Shuffled()))
    mse(model(x[:4]), y[:4]).backward()  # a whole window of plain backwards: fine
    try:
        if gs.rank() == 0:  # the next window: plain here, num_items on the other rank
            mse(model(x[4:8]), y[4:8]).backward()
        else:
            model.backward(mse(model(x[4:8]), y[4:8]), num_items=4)
    except gs.UsageError as e:
        return str(e)
    return None


@pytest.mark.parametrize("wrapper", ["dp", "fsdp"])
def test_mixing_is_caught_in_every_window_not_just_the_first(wrapper):
    """A plain pass must be counted in each window (each pass), on every rank."""
    messages = gs.spawn(_mixed_across_ranks_in_a_later_window, 2, wrapper)
    assert all(m and "mixed" in m for m in messages), messages
