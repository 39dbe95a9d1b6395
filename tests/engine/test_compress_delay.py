"""Compressed gradients applied one step late (``--compress-delay 1``, ``compress/delayed.py``).

Two gloo ranks, float64 where exactness is claimed. Claims:

* with an exact stand-in compressor (an all-reduce) and delay 1, the trajectory is
  one process's that applies step s-1's whole-batch gradient at step s (nothing at
  step 1, the last step's at the flush), 1e-12, with uneven items per rank;
* delay 0 is the undelayed path: the same object path, bitwise the same parameters;
* bf16, fp16, int8, PowerSGD with delay 1: replicas bitwise identical after every
  step; the reports name the applied step ([] then [s-1], [T-1, T] at the end) and a
  probe's distance comes with the gradient it measured;
* a run checkpointed at step 3 (pending sum included) and resumed in a fresh
  strategy equals the uninterrupted run bitwise;
* ``--compress-delay`` without ``--compress`` is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.engine.compress import CompressedBuckets, Compressor
from gradsync.engine.strategy.options import SyncOptions
from gradsync.engine.strategy.registry import build_strategy
from gradsync.engine.transport import comm
from gradsync.errors import UsageError
from tests.helpers import D_IN, D_OUT, SharedSpawn, dataset, job_table, mlp, mse, same_tensors

STEPS = 5
METHODS = ("bf16", "fp16", "int8", "powersgd:1")


class ExactSum(Compressor):
    """A "compressor" that all-reduces exactly: the delay alone, with nothing lost."""

    name = "exact"

    def _reduce(self, key, x, shapes, group, rank, world) -> int:
        comm.all_reduce(x, group, tag="exact-sum")
        return 0


def _idx(step: int, rank: int) -> list[int]:
    """Uneven shares, and a global count that changes every step (10, 12, 14, 10, ...):
    a sum divided by another step's count shows. Disjoint: rank 1 starts after rank 0."""
    return [(11 * step + 6 * rank + i) % 96 for i in range(3 + 4 * rank + step % 3)]


def _params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _exact_delayed(steps=STEPS):
    """DataParallel + CompressedBuckets(ExactSum, delay=1) + SGD with momentum."""
    x, y = dataset()
    red = CompressedBuckets(ExactSum(), delay=1)
    dp = gs.DataParallel(mlp(), bucket_cap_mb=0.0005, first_bucket_mb=0.0001, reduction=red)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    first_grads, applied = None, []
    for s in range(steps):
        idx = _idx(s, gs.rank())
        dp.backward(mse(dp(x[idx]), y[idx]), num_items=len(idx))
        if s == 0:
            first_grads = [p.grad for p in dp.module.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        applied.append(red.delayed.take_applied()[0])
    before = _params(dp.module)
    flushed = red.flush()
    opt.step()
    again = red.flush()  # nothing left
    red.close()
    return {"first_grads_none": all(g is None for g in first_grads), "applied": applied,
            "before_flush": before, "params": _params(dp.module), "flushed": flushed,
            "again": again, "buckets": len(dp.buckets)}


def _reference(steps=STEPS):
    """One process: step s computes g_s and applies g_{s-1}; the flush applies g_T."""
    x, y = dataset()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prev = None
    for s in range(steps):
        idx = [i for r in range(2) for i in _idx(s, r)]
        model.zero_grad(set_to_none=True)
        mse(model(x[idx]), y[idx]).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if prev is not None:
            for p, g in zip(model.parameters(), prev):
                p.grad = g
            opt.step()
        prev = grads
    before = _params(model)
    for p, g in zip(model.parameters(), prev):
        p.grad = g
    opt.step()
    return before, _params(model)


def _train(strategy, steps, first=1, last=None, record=None):
    """The loop's calls, as ``train/step/train_step.py`` makes them: steps ``first``..``last``."""
    x, y = dataset()
    last = last or steps
    reports, params = [], []
    for s in range(first, last + 1):
        idx = _idx(s, gs.rank())
        model = strategy.model
        model.backward(mse(model(x[idx]), y[idx]), num_items=len(idx))
        strategy.clip_grad_norm_(None)
        strategy.optimizer.step()
        strategy.after_step(10)
        if s == steps:
            strategy.finish()
        strategy.optimizer.zero_grad(set_to_none=True)
        reports.append(strategy.step_report())
        params.append(_params(strategy.module))
    return reports, params


def _build(spec, delay, seed=0, probe_every=0, **kw):
    sync = SyncOptions(compress=spec, compress_delay=delay, probe_every=probe_every, **kw)
    return build_strategy(mlp(seed), "ddp", "fp32", torch.optim.SGD, bucket_cap_mb=0.0005,
                          sync=sync, lr=0.1, momentum=0.9)


def _replicas(steps=STEPS):
    """Every method with delay 1 (probe every 2 compressed windows): params, reports."""
    out = {}
    for spec in METHODS:
        strategy = _build(spec, 1, probe_every=2)
        reports, params = _train(strategy, steps)
        strategy.reduction.close()
        out[spec] = {"reports": reports, "params": params}
    return out


def _delay0(steps=4):
    """int8 with compress_delay=0 and with the option left out: the same path."""
    runs = {}
    for name, kw in (("zero", {"compress_delay": 0}), ("default", {})):
        sync = SyncOptions(compress="int8", probe_every=0, **kw)
        strategy = build_strategy(mlp(), "ddp", "fp32", torch.optim.SGD, bucket_cap_mb=0.0005,
                                  sync=sync, lr=0.1, momentum=0.9)
        reports, params = _train(strategy, steps)
        runs[name] = {"params": params, "reports": reports,
                      "delayed": strategy.reduction.delayed is not None}
        strategy.reduction.close()
    return runs


def _resume(steps=6, cut=3):
    """int8 delay 1: uninterrupted, and saved after step ``cut`` then resumed afresh."""
    full = _build("int8", 1)
    whole, _ = _train(full, steps)
    uninterrupted = _params(full.module)
    full.reduction.close()

    a = _build("int8", 1)
    first, _ = _train(a, steps, last=cut)
    module_state = copy.deepcopy(a.full_state_dict())  # every rank (a collective)
    opt_state = copy.deepcopy(a.optimizer_state_dict())
    box = [copy.deepcopy(a.extra_state())]  # rank 0 writes its own: identical elsewhere
    dist.broadcast_object_list(box, src=0)
    pending_window = box[0]["pending"]["window"]
    a.reduction.close()

    b = _build("int8", 1, seed=7)  # other initial values: the checkpoint must set them
    b.load_full_state_dict(module_state)
    b.load_optimizer_state_dict(opt_state)
    b.load_extra_state(box[0])
    second, _ = _train(b, steps, first=cut + 1)
    resumed = _params(b.module)
    b.reduction.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "pending_window": pending_window,
            "steps_whole": [r["grad_steps"] for r in whole],
            "steps_resumed": [r["grad_steps"] for r in first + second]}


class _Skip(nn.Module):
    """``b`` takes part only when ``use_b`` is set (on every rank alike)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D_IN, D_OUT).double(), nn.Linear(D_IN, D_OUT).double()
        self.use_b = True

    def forward(self, x):
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def _unused(steps=4):
    """find_unused_parameters: ``b`` unused in window 2, so step 3 leaves its .grad None."""
    x, y = dataset()
    red = CompressedBuckets(ExactSum(), delay=1)
    dp = gs.DataParallel(_Skip(), find_unused_parameters=True, reduction=red)
    none = []
    for s in range(steps):
        dp.module.use_b = s != 1
        idx = _idx(s, gs.rank())
        dp.backward(mse(dp(x[idx]), y[idx]), num_items=len(idx))
        none.append((dp.module.a.weight.grad is None, dp.module.b.weight.grad is None))
        dp.zero_grad()
    red.close()
    return none


JOBS = job_table(("exact", _exact_delayed, ()), ("replicas", _replicas, ()),
                 ("delay0", _delay0, ()), ("resume", _resume, ()), ("unused", _unused, ()))
SPAWN = SharedSpawn(JOBS, timeout_s=120)


def _results(name):
    return SPAWN.results(name, 2)


def test_exact_stand_in_is_the_one_step_late_trajectory():
    """The optimizer sees step s-1's item-weighted mean at step s; the flush applies the
    last one; the first step applies nothing (every .grad None: SGD skips them)."""
    before_ref, after_ref = _reference()
    for res in _results("exact"):
        assert res["buckets"] > 1
        assert res["first_grads_none"]
        assert res["applied"] == [[]] + [[s] for s in range(1, STEPS)], res["applied"]
        assert res["flushed"] and not res["again"]
        for got, want in zip(res["before_flush"], before_ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for got, want in zip(res["params"], after_ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_delay_zero_is_the_undelayed_path_bitwise():
    for res in _results("delay0"):
        zero, default = res["zero"], res["default"]
        assert all(same_tensors(a, b) for a, b in zip(zero["params"], default["params"]))
        assert not same_tensors(zero["params"][0], _params(mlp()))  # step 1 applied its own
        assert not zero["delayed"] and not default["delayed"]
        assert all("grad_steps" not in r for r in zero["reports"])


@pytest.mark.parametrize("spec", METHODS)
def test_replicas_bitwise_identical_with_a_delay(spec):
    r0, r1 = (res[spec] for res in _results("replicas"))
    for s in range(STEPS):
        assert same_tensors(r0["params"][s], r1["params"][s]), f"{spec}: step {s + 1} differs"
    steps = [r["grad_steps"] for r in r0["reports"]]
    assert steps == [[], [1], [2], [3], [4, 5]], steps
    assert same_tensors(r0["params"][0], _params(mlp()))  # step 1 applied nothing
    assert not same_tensors(r0["params"][1], r0["params"][0])
    # compressed windows 2, 4 are probed (every 2 from the first); applied at steps 3, 5
    probed = [s + 1 for s, r in enumerate(r0["reports"]) if "grad_cosine" in r]
    assert probed == [3, 5], probed
    assert all(r["sent_bytes"] > 0 for r in r0["reports"][1:]), r0["reports"]


def test_resumed_run_equals_the_uninterrupted_one_bitwise():
    for res in _results("resume"):
        assert res["pending_window"] == 3
        gap = max(float((a - b).abs().max()) for a, b in zip(res["uninterrupted"],
                                                             res["resumed"]))
        assert same_tensors(res["uninterrupted"], res["resumed"]), f"max |diff| {gap:.3g}"
        assert res["steps_whole"] == res["steps_resumed"] == [[], [1], [2], [3], [4], [5, 6]]


def test_unused_parameter_follows_the_applied_window():
    """Rule 1 (a parameter no rank used keeps .grad None) by the mask of the window whose
    sum is applied: b, unused in window 2, has no gradient at step 3, though used there."""
    for res in _results("unused"):
        assert [tuple(r) for r in res] == [(True, True), (False, False), (False, True),
                                           (False, False)], res


def test_flag_refused_without_compress():
    from gradsync.train.config.train_config import TrainConfig

    for kw in ({}, {"sync": "diloco", "compress": "int8"}):
        with pytest.raises(UsageError) as err:
            TrainConfig(out="x", compress_delay=1, **kw)
        msg = str(err.value)
        assert "--compress-delay 1" in msg and "\n" not in msg, msg
    with pytest.raises(UsageError, match="--compress-delay must be 0 or 1"):
        SyncOptions(compress="int8", compress_delay=2)
    with pytest.raises(ValueError, match="delay must be 0 or 1"):
        CompressedBuckets(ExactSum(), delay=2)
    TrainConfig(out="x", compress="int8", compress_delay=1)  # accepted with --compress
    TrainConfig(out="x", compress_delay=0)  # the default: accepted anywhere
