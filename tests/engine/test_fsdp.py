"""FullyShardedDataParallel (stage 3) against one process on the whole batch, in float64."""

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.engine.transport import comm
from tests.engine.sharded_models import Block, Net
from tests.helpers import (
    SHARDED_STEPS,
    SHARDED_TOL,
    ShardOptimizer,
    SharedSpawn,
    Tied,
    Tiny,
    dataset,
    max_gap,
    mse,
    optimizer_spec,
    reference_train,
    same_tensors,
    sharded_train,
    uneven_schedule,
)

STEPS = SHARDED_STEPS
TOL = SHARDED_TOL




def _fsdp(factory, wrap, kind, schedule, clip=None, collectives="auto", prefetch=1):
    x, y = dataset()
    model = gs.FullyShardedDataParallel(factory(), wrap=wrap, collectives=collectives,
                                        prefetch=prefetch)
    cls, kw = optimizer_spec(kind)
    opt = cls(model.parameters(), **kw)

    sharded_train(model, ShardOptimizer(model, opt), schedule, x, y, gs.rank(), clip=clip)
    return list(model.full_state_dict().items())


def _both(factory, wrap, schedule, clip=None, collectives="auto", prefetch=1):
    return {k: _fsdp(factory, wrap, k, schedule, clip, collectives, prefetch)
            for k in ("sgd", "adamw")}


def _check(results, world, factory, schedule, clip=None):
    assert len(results) == world
    x, y = dataset()
    for kind in ("sgd", "adamw"):
        ref_model = factory()
        ref = reference_train(ref_model, kind, schedule, x, y, clip=clip)
        names = [n for n, _ in ref_model.named_parameters()]
        got = dict(results[0][kind])
        assert list(got) == list(ref_model.state_dict())  # original names, original order
        for r in range(1, len(results)):
            other = dict(results[r][kind])
            assert list(other) == list(got), f"rank {r}"
            assert same_tensors(other.values(), got.values()), f"rank {r}"
        gap = max_gap([got[n] for n in names], ref)
        assert gap <= TOL[kind], f"{kind}: gap {gap:.3e}"


SCHED = {w: uneven_schedule(STEPS, w, same_micro_steps=True) for w in (2, 3)}


def _jobs(world):
    """Everything this module runs on ``world`` workers, in one spawn (tests stay fast)."""
    if world == 2:
        # world 2 without prefetch, world 3 with it: both gather schedules are exact
        return {"net": (_both, (Net, {Block}, SCHED[2], None, "native", 0)),
                "count": (_count, ()), "bf16": (_bf16, (20,)),
                "forward_without_backward": (_forward_without_backward, ())}
    return {"net": (_both, (Net, {Block}, SCHED[3], None, "auto")),
            "tied": (_both, (Tied, {nn.Linear}, SCHED[3], None, "all_reduce")),
            "tiny/clip": (_both, (Tiny, None, SCHED[3], 0.05))}


SPAWN = SharedSpawn(_jobs)


def _results(world, name):
    return SPAWN.results(name, world)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_single_process_with_uneven_items(world):
    _check(_results(world, "net"), world, Net, SCHED[world])


def test_fsdp_tied_weights_and_tiny_model():
    _check(_results(3, "tied"), 3, Tied, SCHED[3])
    _check(_results(3, "tiny/clip"), 3, Tiny, SCHED[3], clip=0.05)


def _count():
    x, y = dataset()
    model = gs.FullyShardedDataParallel(Net(), wrap={Block}, collectives="native")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    with comm.add_observer(lambda k, ev: events.append(ev.op) if k == "launch" else None):
        with model.no_sync():
            model.backward(mse(model(x[:4]), y[:4]), num_items=4)
        no_sync = list(events)
        events.clear()
        model.backward(mse(model(x[4:9]), y[4:9]), num_items=5)
        synced = list(events)
        events.clear()
        opt.step()
        stepped = list(events)
    return {"no_sync": no_sync, "synced": synced, "stepped": stepped, "units": len(model.units)}


def test_collectives_per_step():
    res = _results(2, "count")[0]
    no_sync, synced, stepped, units = (res[k] for k in ("no_sync", "synced", "stepped", "units"))
    assert units == 3  # root + two blocks
    # forward gathers every unit, backward re-gathers every unit but the root and the
    # last block (kept gathered from forward into backward); no gradient traffic
    assert no_sync == ["all_gather"] * (2 * units - 2)
    assert sorted(synced) == sorted(["all_gather"] * (2 * units - 2) + ["all_reduce"]
                                    + ["reduce_scatter"] * units)
    assert stepped == []  # the optimizer steps on local shards


def _bf16(steps):
    x, y = dataset()
    x, y = x.float(), y.float()
    model = gs.FullyShardedDataParallel(Net(hidden=32).float(), wrap={Block},
                                        mixed_precision=gs.MixedPrecision())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = [[[list(range(r * 24, r * 24 + 24))] for r in range(2)] for _ in range(steps)]
    for step in sched:
        idx = step[gs.rank()][0]
        model.backward(mse(model(x[idx]), y[idx]), num_items=len(idx))
        opt.step()
        report = model.memory_report(opt)
        opt.zero_grad()
    return {"report": report, "state": model.full_state_dict(), "schedule": sched}


def test_bf16_memory_matches_formula_and_stays_close_to_fp32():
    res = _results(2, "bf16")[0]
    report, state, sched = res["report"], res["state"], res["schedule"]
    expected = report.formula()  # 16P/N
    assert report.params == 0  # nothing gathered between steps
    assert abs(report.model_state - expected) <= 0.05 * expected, report.render()
    x, y = dataset()
    x, y = x.float(), y.float()
    ref_model = Net(hidden=32).float()
    reference_train(ref_model, "adamw", sched, x, y)
    # Same reasoning as the stage 1/2 bf16 test (test_zero.py): per-element gaps are loose
    # under AdamW (measured 0.064 here, of weights that travelled ~0.2), the loss is tight.
    got = [state[n] for n, _ in ref_model.named_parameters()]
    assert 0 < max_gap(got, [p.detach() for p in ref_model.parameters()]) <= 0.1
    bf = Net(hidden=32).float()
    bf.load_state_dict(state)
    with torch.no_grad():
        loss_bf, loss_ref = mse(bf(x), y).item(), mse(ref_model(x), y).item()
    assert abs(loss_bf - loss_ref) <= 0.01 * loss_ref, (loss_bf, loss_ref)


def _forward_without_backward():
    x, _ = dataset()
    model = gs.FullyShardedDataParallel(Net(), wrap={Block})
    model(x[:4])  # with grad and no backward: the root and the last block stay gathered
    kept = [u.kept for u in model.units]
    with torch.no_grad():
        for shard in model.parameters():  # e.g. an optimizer step or a loaded checkpoint
            shard.mul_(0.5)
    ref = Net()
    ref.load_state_dict(model.full_state_dict())
    with torch.no_grad():
        out = model(x[:4])
    gathered = [u.full.untyped_storage().nbytes() for u in model.units]
    return {"kept": kept, "same": torch.equal(out, ref(x[:4])), "gathered": gathered}


def test_units_kept_for_backward_are_refreshed_by_the_next_forward():
    """The root and the last unit stay gathered from forward into backward; a forward
    that no backward followed must not leave stale parameters behind."""
    for res in _results(2, "forward_without_backward"):
        assert res["kept"] == [True, False, True]  # root, first block, last block
        assert res["same"] is True  # the next forward used the changed shards
        assert res["gathered"] == [0, 0, 0]  # an eval forward keeps nothing gathered


def _bf16_with_frozen(kind):
    """A frozen first layer (fine-tuning a pretrained stem) under bf16: stage 3 casts
    it to the compute dtype as DataParallel's mixed precision does (it stayed float32,
    and its forward met bf16 inputs: a dtype error)."""
    x, y = dataset()
    x, y = x.float(), y.float()
    module = Net(hidden=32).float()
    frozen = next(module.children())
    frozen.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    mp = gs.MixedPrecision()
    if kind == "fsdp":
        model = gs.FullyShardedDataParallel(module, wrap={Block}, mixed_precision=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model = gs.DataParallel(module)
        opt = gs.MixedPrecisionOptimizer(model, torch.optim.AdamW, mp, lr=1e-2)
    rows = list(range(gs.rank() * 24, gs.rank() * 24 + 24))
    for _ in range(2):
        model.backward(mse(model(x[rows]).float(), y[rows]), num_items=len(rows))
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict() if kind == "fsdp" else module.state_dict()
    after = {n: p.detach() for n, p in frozen.named_parameters()}
    unchanged = all(torch.equal(after[n], before[n].to(after[n].dtype)) for n in before)
    return {"state": {k: v.float() for k, v in state.items()}, "frozen_unchanged": unchanged,
            "frozen_dtype": str(after["weight"].dtype)}


def test_bf16_with_a_frozen_layer_trains_as_data_parallel():
    fsdp, dp = (gs.spawn(_bf16_with_frozen, 2, kind, timeout_s=60)[0] for kind in ("fsdp", "dp"))
    assert fsdp["frozen_unchanged"] is True and dp["frozen_unchanged"] is True
    assert fsdp["frozen_dtype"] == dp["frozen_dtype"] == "torch.bfloat16"
    assert list(fsdp["state"]) == list(dp["state"]) and dp["state"]
    for name, value in dp["state"].items():  # fp32 sums in another order: a bf16 ulp at most
        assert torch.allclose(fsdp["state"][name].bfloat16().float(), value, rtol=2**-7,
                              atol=1e-3), name
