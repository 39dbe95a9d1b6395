"""The per-step hot path at GPU speed: gradients stay in their buckets across zero_grad.

``zero_grad(set_to_none=True)`` on the optimizer alone drops every ``.grad`` view;
the next backward then allocates each gradient afresh and the hook copies it into
its bucket (a second gradient-sized allocation and a copy, every step). The
strategy's ``zero_grad`` zeroes the buckets in place and the window re-points the
views, so autograd accumulates straight into them (``DataParallel.grad_copies``
counts the copies). Exact either way: float64 against one process.
"""

import torch

import gradsync as gs
from gradsync.engine.strategy.registry import build_strategy
from tests.helpers import dataset, mlp, mse

STEPS = 4


def _job(zero: str):
    torch.manual_seed(0)
    strat = build_strategy(mlp(), "ddp", "fp32", torch.optim.AdamW, bucket_cap_mb=0.001,
                           lr=1e-2)
    x, y = dataset(n=64)
    per_step = []
    for step in range(STEPS):
        xb = x[8 * step + 4 * gs.rank():8 * step + 4 * gs.rank() + 4]
        yb = y[8 * step + 4 * gs.rank():8 * step + 4 * gs.rank() + 4]
        before = strat.model.grad_copies
        strat.model.backward(mse(strat.model(xb), yb), num_items=len(xb))
        per_step.append(strat.model.grad_copies - before)
        views = all(p.grad is b.views[k] for b in strat.model.buckets
                    for k, p in enumerate(b.params))
        strat.optimizer.step()
        if zero == "strategy":
            strat.zero_grad()
        else:
            strat.optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in strat.model.module.parameters())
    return {"copies": per_step, "views": views,
            "params": [p.detach().clone() for p in strat.model.module.parameters()]}


def _reference():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = dataset(n=64)
    for step in range(STEPS):
        mse(model(x[8 * step:8 * step + 8]), y[8 * step:8 * step + 8]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_the_strategy_zero_grad_keeps_gradients_in_their_buckets():
    ours = gs.spawn(_job, 2, "strategy", timeout_s=60)
    plain = gs.spawn(_job, 2, "optimizer", timeout_s=60)
    n = len(list(mlp().parameters()))
    for r in range(2):
        assert ours[r]["copies"] == [0] * STEPS, ours[r]["copies"]
        # the optimizer's zero_grad alone: every gradient copied in, every step after the
        # first (the buckets start zeroed): what the strategy's saves
        assert plain[r]["copies"] == [0] + [n] * (STEPS - 1), plain[r]["copies"]
        assert ours[r]["views"]
    ref = _reference()
    for r in range(2):
        for a, b, c in zip(ours[r]["params"], plain[r]["params"], ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def _measure_job(strategy: str):
    torch.manual_seed(0)
    strat = build_strategy(mlp(), strategy, "fp32", torch.optim.SGD, bucket_cap_mb=0.001,
                           lr=0.1)
    x, y = dataset(n=16)
    xb, yb = x[4 * gs.rank():4 * gs.rank() + 4], y[4 * gs.rank():4 * gs.rank() + 4]
    strat.model.backward(mse(strat.model(xb), yb), num_items=4)
    grads = [g for g in (strat._clip_target().grad_shards() if strategy != "ddp" else
                         [p.grad for p in strat.model.module.parameters()]) if g is not None]
    versions = [g._version for g in grads]
    measured = strat.clip_grad_norm_(None)  # --clip off: the norm is still reported
    untouched = [g._version for g in grads] == versions
    clipped = strat.clip_grad_norm_(1e-3)  # on: every gradient rewritten once
    return {"untouched": untouched, "measured": float(measured), "clipped": float(clipped),
            "rewritten": [g._version for g in grads] != versions}


def test_no_clipping_work_when_clip_is_off():
    """The norm is measured (the NaN guard and the metrics read it), no gradient is
    rewritten; the number is the one clipping would have computed."""
    for strategy in ("ddp", "zero2"):
        for r in gs.spawn(_measure_job, 2, strategy, timeout_s=60):
            assert r["untouched"] and r["rewritten"], (strategy, r)
            assert r["measured"] == r["clipped"], (strategy, r)
