"""fp16 loss scaling (``engine/sync/loss_scale.py``): exact, skipped alike on every rank.

Claims, each for DataParallel with MixedPrecisionOptimizer, ZeRO-1, ZeRO-2 and stage 3:

* the scale divides out exactly: in float64, with a power-of-two scale that grows
  during the run, training equals the unscaled run bit for bit, and one process on
  the whole global batch to 1e-12 / 1e-9 (uneven shards, no_sync, empty ranks), while
  the gradient backward produced really was scaled (2**10 times the unscaled one);
* an inf in one element of one rank's gradient skips that step on every rank:
  parameters, masters and optimizer state bitwise unchanged, the scale halved, the
  counter at 1, the steps after it train, and the scale grows after the interval.
  Sharded ranks hold different shards, so only one of them sees the inf: they agree
  through the flag's all-reduce (without it the replicas would part);
* with fp16 the gradient the fp32 masters step is the fp32 sum, not its fp16 copy: a
  5e-9 gradient survives there while ``.grad`` (fp16) holds 0;
* an overflow at ``min_scale`` is dropped too but not put down to scaling
  ("nonfinite"); a plain ``loss.backward()`` and ``backward(loss)`` without
  ``num_items`` are refused, on every rank alike.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError
from tests.engine.sharded_models import Block, Net
from tests.helpers import (
    SHARDED_TOL,
    SharedSpawn,
    dataset,
    errors_of,
    mlp,
    mse,
    optimizer_spec,
    reference_train,
    uneven_schedule,
)

STEPS = 20
SCALE = gs.LossScale(init_scale=2.0 ** 10, growth_interval=3)  # grows 6 times in 20 steps
KINDS = ("ddp", "zero1", "zero2", "zero3")
SCHED = uneven_schedule(STEPS, 2)
SCHED_SAME = uneven_schedule(STEPS, 2, same_micro_steps=True)  # stage 3 gathers every forward


# ----------------------------------------------------------------------------- the policy
def test_the_policy_backs_off_grows_and_gives_up_at_its_minimum():
    sc = gs.LossScaler(gs.LossScale(init_scale=8.0, growth_interval=2, min_scale=2.0))
    verdicts = [sc.record(f) for f in (True, True, False, False, False, False, True)]
    assert verdicts == ["finite", "finite", "overflow", "overflow", "overflow", "nonfinite",
                        "finite"]
    # 8 -> 16 (2 finite) -> 8 -> 4 -> 2 (the minimum) -> still 2 -> 2 (tracker 1)
    assert (sc.scale, sc.skipped, sc.growth_tracker) == (2.0, 3, 1)
    other = gs.LossScaler(sc.config)
    other.load_state_dict(sc.state_dict())
    assert (other.scale, other.skipped, other.growth_tracker) == (2.0, 3, 1)
    static = gs.LossScaler(gs.LossScale(init_scale=4.0, dynamic=False))
    assert [static.record(f) for f in (False, True)] == ["overflow", "finite"]
    assert static.scale == 4.0 and static.skipped == 1


@pytest.mark.parametrize("field,value", [("init_scale", 1000.0), ("min_scale", 0.3),
                                         ("growth_factor", 1.0), ("growth_factor", 3.0),
                                         ("backoff_factor", 1.0), ("backoff_factor", 0.3),
                                         ("growth_interval", 0), ("init_scale", 0.5)])
def test_a_scale_that_would_not_divide_out_exactly_is_refused(field, value):
    with pytest.raises(UsageError, match=f"LossScale.{field}|init_scale"):
        gs.LossScale(**{field: value})


def test_fp16_comes_with_a_loss_scale_and_fp32_sums():
    assert gs.MixedPrecision(torch.float16).loss_scale == gs.LossScale()
    assert gs.MixedPrecision(torch.bfloat16).loss_scale is None
    with pytest.raises(UsageError, match="reduce_dtype"):
        gs.MixedPrecision(torch.float16, reduce_dtype=torch.float16)


# ----------------------------------------------------------------------------- helpers
class _Poison(torch.autograd.Function):
    """The identity forward; backward puts inf into one element of the gradient."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[0] = float("inf")
        return g


POISON = {"on": False}


class PoisonNet(Net):
    """``Net`` whose first weight's gradient gets an inf while ``POISON['on']``."""

    def forward(self, x):
        w = _Poison.apply(self.inp.weight) if POISON["on"] else self.inp.weight
        return self.head(self.blocks(torch.tanh(F.linear(x, w, self.inp.bias))))


def _build(kind, module, mp, opt_kind="adamw"):
    """(model, optimizer, what to snapshot) for one of KINDS."""
    cls, kw = optimizer_spec(opt_kind)
    if kind == "zero3":
        model = gs.FullyShardedDataParallel(module, wrap={Block}, mixed_precision=mp)
        opt = cls(model.parameters(), **kw)
        return model, opt, lambda: [*_tensors(opt.state_dict()), *model.shards]
    model = gs.DataParallel(module, bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
    if kind == "ddp":
        opt = gs.MixedPrecisionOptimizer(model, cls, mp, **kw)
    else:
        opt = gs.ZeroOptimizer(model, cls, stage=int(kind[-1]), mixed_precision=mp, **kw)
    return model, opt, lambda: [*_tensors(opt.state_dict()), *model.module.parameters()]


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _snapshot(what) -> list:
    return [t.detach().clone() for t in what()]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def _step(model, opt, micros, x, y, probe=None):
    """One optimizer step over this rank's micro-batches (no_sync but for the last)."""
    for k, idx in enumerate(micros):
        with model.no_sync() if k < len(micros) - 1 else contextlib.nullcontext():
            if not idx:
                model.backward(None, num_items=0)
                continue
            out = model(x[idx])
            if probe is not None and not probe:
                out.register_hook(lambda g: probe.append(g.abs().max().item()))
            model.backward(mse(out, y[idx]), num_items=len(idx))
    opt.step()
    opt.zero_grad()


def _params(kind, model):
    if kind == "zero3":
        return list(model.full_state_dict().values())
    return [p.detach().clone() for p in model.module.parameters()]


# ----------------------------------------------------------------------------- jobs
def _exact(kind, scaled):
    x, y = dataset()
    factory = Net if kind == "zero3" else mlp
    mp = gs.MixedPrecision(torch.float64, torch.float64, loss_scale=SCALE if scaled else None)
    out = {}
    for opt_kind in ("sgd", "adamw"):
        model, opt, _ = _build(kind, factory(), mp, opt_kind)
        probe = []
        for step in SCHED_SAME if kind == "zero3" else SCHED:
            _step(model, opt, step[gs.rank()], x, y, probe)
        scaler = model.loss_scaler
        out[opt_kind] = {"params": _params(kind, model), "probe": probe[0] if probe else None,
                         "scale": scaler.scale if scaler else None}
    return out


def _overflow(kind, k=3, steps=6, scale=None):
    """Train ``steps`` fp16 steps, rank 1 poisoning one gradient element at step ``k``."""
    x, y = dataset()
    scale = scale or gs.LossScale(init_scale=16.0, growth_interval=2)
    model, opt, what = _build(kind, PoisonNet(), gs.MixedPrecision(torch.float16,
                                                                   loss_scale=scale))
    rank, per = gs.rank(), 4
    used, verdicts, changed = [], [], []
    for s in range(1, steps + 1):
        before = _snapshot(what)
        POISON["on"] = s == k and rank == 1
        try:
            base = (s * 2 * per) % len(x)
            _step(model, opt, [list(range(base + rank * per, base + (rank + 1) * per))], x, y)
        finally:
            POISON["on"] = False
        used.append(model.loss_scaler.used)
        verdicts.append(model.loss_scaler.verdict)
        changed.append(not _same(before, _snapshot(what)))
    sc = model.loss_scaler
    return {"used": used, "verdicts": verdicts, "changed": changed, "scale": sc.scale,
            "skipped": sc.skipped, "params": _params(kind, model)}


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.w = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.w(x)


def _tiny_gradient(kind):
    """A true gradient of about 5e-9 (below fp16's smallest subnormal, 6e-8): what the
    masters step, and what the fp16 ``.grad`` holds."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(8, 4, generator=g, dtype=torch.float64) + 0.5
    module = _Scaled()
    if kind == "zero3":
        model = gs.FullyShardedDataParallel(module, mixed_precision=gs.MixedPrecision(
            torch.float16))
        opt = None
    else:
        model, opt, _ = _build(kind, module, gs.MixedPrecision(torch.float16))
    idx = slice(4 * gs.rank(), 4 * gs.rank() + 4)
    out = model(x[idx])
    model.backward(out.double().sum() / 4 * 1e-8, num_items=4)
    if kind == "ddp":
        master = [opt._grad(p) for p in opt._params]
        fp16 = [p.grad for p in opt._params]
    elif kind == "zero3":
        master, fp16 = model.grad_shards(), []
    else:
        master, fp16 = opt.grad_shards(), [p.grad for p in model.module.parameters()]
    expect = (x.half().double().sum(0) / 8 * 1e-8).tolist()
    grads = opt.memory_report().grads if kind.startswith("zero") and opt else None
    return {"expect": expect, "report_grads": grads, "master": [v for t in master if t is not None
                                         for v in t.double().flatten().tolist()],
            "dtypes": sorted({str(t.dtype) for t in master if t is not None}),
            "fp16": [float(t.abs().max()) for t in fp16 if t is not None]}


def _refusals():
    x, y = dataset()

    def plain():
        model, opt, _ = _build("ddp", mlp(), gs.MixedPrecision(torch.float16))
        mse(model(x[:4]), y[:4]).backward()

    def no_items():
        model, opt, _ = _build("ddp", mlp(), gs.MixedPrecision(torch.float16))
        model.backward(mse(model(x[:4]), y[:4]))

    return errors_of(plain=plain, no_items=no_items)


def _lr_after_load():
    """MixedPrecisionOptimizer restored from its state dict: does a scheduler's lr (set in
    its param_groups) still reach the inner optimizer? With lr 0 a step changes nothing."""
    x, y = dataset()
    mp = gs.MixedPrecision(torch.bfloat16)  # no loss scale: every step is taken
    batch = [list(range(4 * gs.rank(), 4 * gs.rank() + 4))]
    model, opt, _ = _build("ddp", mlp(), mp)
    _step(model, opt, batch, x, y)
    model2, opt2, _ = _build("ddp", mlp(), mp)
    opt2.load_state_dict(opt.state_dict())
    opt2.param_groups[0]["lr"] = 0.0
    before = _snapshot(lambda: model2.module.parameters())
    _step(model2, opt2, batch, x, y)
    return _same(before, _snapshot(lambda: model2.module.parameters()))


def _jobs(world):
    jobs = {f"exact/{kind}/{scaled}": (_exact, (kind, scaled))
            for kind in KINDS for scaled in (True, False)}
    jobs.update({f"overflow/{kind}": (_overflow, (kind,)) for kind in KINDS})
    jobs["overflow/minimum"] = (_overflow, ("ddp", 2, 3, gs.LossScale(init_scale=1.0)))
    jobs.update({f"tiny/{kind}": (_tiny_gradient, (kind,)) for kind in KINDS})
    jobs["refusals"] = (_refusals, ())
    jobs["lr_after_load"] = (_lr_after_load, ())
    return jobs


SPAWN = SharedSpawn(_jobs, timeout_s=240)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", KINDS)
def test_the_scale_divides_out_exactly_in_float64(kind):
    scaled = SPAWN.results(f"exact/{kind}/True", 2)
    plain = SPAWN.results(f"exact/{kind}/False", 2)
    x, y = dataset()
    for opt_kind in ("sgd", "adamw"):
        s0, p0 = scaled[0][opt_kind], plain[0][opt_kind]
        assert s0["scale"] == 2.0 ** 16  # 2**10, grown after every 3 finite steps
        assert s0["probe"] == p0["probe"] * 2.0 ** 10  # backward saw the scaled loss
        for r in (0, 1):  # bit for bit: with and without the scale, and across ranks
            assert _same(scaled[r][opt_kind]["params"], p0["params"]), f"{opt_kind} rank {r}"
        factory = Net if kind == "zero3" else mlp
        sched = SCHED_SAME if kind == "zero3" else SCHED
        ref = reference_train(factory(), opt_kind, sched, x, y)
        tol = SHARDED_TOL[opt_kind]
        for got, want in zip(s0["params"], ref):
            torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(kind):
    res = SPAWN.results(f"overflow/{kind}", 2)
    for r in res:
        assert r["verdicts"] == ["finite", "finite", "overflow", "finite", "finite", "finite"]
        # 16, grown to 32 after 2 finite steps, halved by the overflow, grown again
        assert r["used"] == [16.0, 16.0, 32.0, 16.0, 16.0, 32.0]
        assert r["scale"] == 32.0 and r["skipped"] == 1
        # step 3 left parameters, masters and optimizer state bitwise as they were
        assert r["changed"] == [True, True, False, True, True, True]
    assert _same(res[0]["params"], res[1]["params"])


def test_an_overflow_at_the_minimum_scale_is_not_scalings():
    for r in SPAWN.results("overflow/minimum", 2):
        assert r["verdicts"] == ["finite", "nonfinite", "finite"]
        assert r["changed"] == [True, False, True]  # dropped all the same
        assert r["skipped"] == 0 and r["scale"] == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_the_masters_step_the_fp32_sum_not_its_fp16_copy(kind):
    res = SPAWN.results(f"tiny/{kind}", 2)
    # ddp: the whole gradient on every rank; sharded: each rank its half of it
    got = res[0]["master"] if kind == "ddp" else res[0]["master"] + res[1]["master"]
    assert sorted(got) == pytest.approx(sorted(res[0]["expect"]), rel=1e-2)
    assert min(got) > 1e-9
    for r in res:
        assert r["dtypes"] == ["torch.float32"]
        assert all(v == 0.0 for v in r["fp16"])  # rounded into fp16 it would vanish
        if kind == "zero1":  # the memory report counts the fp32 slice: 4 x 2 B bucket + 2 x 4 B
            assert r["report_grads"] == 16


def test_backward_the_engine_does_not_scale_is_refused_on_every_rank():
    res = SPAWN.results("refusals", 2)
    assert res[0] == res[1]
    for name in ("plain", "no_items"):
        assert "model.backward(loss, num_items=n)" in res[0][name], name


def test_a_restored_mixed_precision_optimizer_follows_its_scheduler():
    """It kept the saved step's lr for the rest of a resumed run (bf16 too)."""
    assert SPAWN.results("lr_after_load", 2) == [True, True]
