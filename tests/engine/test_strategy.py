"""build_strategy: every strategy trains the same model to the same point (float64)."""

import pytest
import torch

import gradsync as gs
from gradsync.engine.strategy.exact import default_wrap, memory_report
from gradsync.engine.strategy.registry import build_strategy
from tests.engine.sharded_models import Block, Net
from tests.helpers import dataset, even_schedule, max_gap, mse, reference_train, sharded_train


def _run(strategy):
    x, y = dataset()
    model, opt = build_strategy(Net(), strategy, "fp32", torch.optim.SGD, bucket_mb=0.0005,
                                lr=0.05, momentum=0.9)
    sched = even_schedule(5, 2, 12, 96)
    sharded_train(model, opt, sched, x, y, gs.rank())
    state = model.full_state_dict() if strategy == "zero3" else dict(model.module.state_dict())
    return {"state": state, "report": memory_report(model, opt), "schedule": sched}


def _bf16_ddp():
    x, y = dataset()
    model, opt = build_strategy(Net(hidden=32).float(), "ddp", "bf16", torch.optim.AdamW,
                                bucket_mb=0.01, lr=1e-2, weight_decay=0.01)
    sched = even_schedule(20, 2, 12, 96)
    reports = []
    sharded_train(model, opt, sched, x.float(), y.float(), gs.rank(),
                  on_step=lambda: reports.append(memory_report(model, opt)))
    return {"state": dict(model.module.state_dict()), "report": reports[-1], "schedule": sched}


STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _run_all():
    return {**{s: _run(s) for s in STRATEGIES}, "ddp/bf16": _bf16_ddp()}


_cache: list = []


def _results():
    if not _cache:
        _cache.append(gs.spawn(_run_all, 2)[0])
    return _cache[0]


def test_bf16_data_parallel_memory_and_accuracy():
    res = _results()["ddp/bf16"]
    state, report, sched = res["state"], res["report"], res["schedule"]
    expected = report.formula()  # 16P: bf16 params and grads, fp32 master and moments
    assert abs(report.model_state - expected) <= 0.05 * expected, report.render()
    x, y = dataset()
    x, y = x.float(), y.float()
    ref_model = Net(hidden=32).float()
    reference_train(ref_model, "adamw", sched, x, y)
    bf = Net(hidden=32).float()
    bf.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():  # same bound and reasoning as the stage 1/2 bf16 test
        loss_bf, loss_ref = mse(bf(x), y).item(), mse(ref_model(x), y).item()
    assert abs(loss_bf - loss_ref) <= 0.01 * loss_ref, (loss_bf, loss_ref)


def test_all_strategies_agree_with_one_process():
    x, y = dataset()
    results = _results()
    assert list(results) == [*STRATEGIES, "ddp/bf16"]
    for stage, strategy in enumerate(STRATEGIES):
        state, report, sched = (results[strategy][k] for k in ("state", "report", "schedule"))
        ref_model = Net()
        ref = reference_train(ref_model, "sgd", sched, x, y)
        assert max_gap([state[n] for n, _ in ref_model.named_parameters()], ref) <= 1e-12
        assert report.stage == stage and report.num_params == sum(p.numel() for p in ref)


def test_default_wrap_and_bad_input():
    assert default_wrap(Net()) == {Block}
    with pytest.raises(gs.UsageError, match="strategy must be one of"):
        build_strategy(Net(), "zero4", "fp32", torch.optim.SGD)
    with pytest.raises(ValueError, match="precision must be one of"):
        build_strategy(Net(), "zero1", "fp8", torch.optim.SGD)
