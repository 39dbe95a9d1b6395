"""What DataParallel refuses, on every rank and by name: unused parameters without
``find_unused_parameters``, models that differ across ranks, uninitialized lazy modules,
mixing ``backward(loss, num_items=n)`` with plain ``loss.backward()``, bad item counts."""

import pytest
import torch
from torch import nn

import gradsync as gs
from tests.engine.dp_models import SCHED, Shuffled, run_dp, unused_factory
from tests.helpers import dataset, mse


def _unused_error():
    try:
        run_dp(unused_factory, SCHED)
    except gs.UnusedParametersError as e:
        return str(e)
    return None


def test_unused_parameters_error_names_them_on_every_rank():
    messages = gs.spawn(_unused_error, 2)
    assert len(messages) == 2
    for r, msg in enumerate(messages):
        assert msg is not None, f"rank {r} raised nothing"
        assert "'spare.weight'" in msg and "'spare.bias'" in msg
        assert "find_unused_parameters=True" in msg


def _mismatch():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2 + gs.rank()))
    try:
        gs.DataParallel(model)
    except gs.ReplicaMismatchError as e:
        return str(e)
    return None


def test_mismatched_models_error_on_every_rank():
    messages = gs.spawn(_mismatch, 3)
    assert len(messages) == 3
    assert all(m == messages[0] for m in messages) and messages[0] is not None
    assert "'1.weight'" in messages[0]
    assert "ranks 0, 1, 2" in messages[0]
    assert "(2, 8)" in messages[0] and "(3, 8)" in messages[0]


def _lazy(wrapper: str):
    """A lazy module wrapped before its dummy forward: on every rank (a usage error), and
    on rank 0 only (a mismatch naming the uninitialized entry, not a hang)."""
    wrap = getattr(gs, wrapper)
    out = {}
    for case, initialized_on in (("everywhere", ()), ("one_rank", (0,))):
        torch.manual_seed(0)
        module = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 1))
        if gs.rank() in initialized_on:
            module(torch.zeros(2, 5))
        try:
            wrap(module)
            out[case] = None
        except (gs.UsageError, gs.ReplicaMismatchError) as e:
            out[case] = {"error": type(e).__name__, "message": str(e)}
    return out


@pytest.mark.parametrize("wrapper", ["DataParallel", "FullyShardedDataParallel"])
def test_uninitialized_lazy_module_is_refused_on_every_rank(wrapper):
    results = gs.spawn(_lazy, 2, wrapper, timeout_s=60)
    assert len(results) == 2
    for res in results:
        everywhere, one_rank = res["everywhere"], res["one_rank"]
        assert everywhere["error"] == "UsageError", everywhere
        assert "'0.weight', '0.bias'" in everywhere["message"]
        assert "forward pass" in everywhere["message"]
        assert one_rank["error"] == "ReplicaMismatchError", one_rank
        assert "shape (3, 5)" in one_rank["message"]
        assert "shape uninitialized" in one_rank["message"]


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
    assert len(messages) == 2
    assert all(m is not None and "mixed" in m for m in messages), messages


@pytest.mark.parametrize("bad", [-1, float("nan"), "three", 2.5])
def test_bad_num_items_rejected(bad):
    from gradsync.engine.sync.core import as_count as _as_count

    with pytest.raises(gs.UsageError, match="num_items"):
        _as_count(bad)


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
    assert len(messages) == 2
    assert all(m is not None and "mixed" in m for m in messages), messages
