"""build_strategy: every strategy trains the same model to the same point (float64)."""

import pytest
import torch
from helpers import dataset, even_schedule, max_gap, reference_train, sharded_train
from test_fsdp import Block, Net

import gradsync as gs
from gradsync.engine.strategy import build_strategy, default_wrap, memory_report


def _run(strategy):
    x, y = dataset()
    model, opt = build_strategy(Net(), strategy, "fp32", torch.optim.SGD, bucket_mb=0.0005,
                                lr=0.05, momentum=0.9)
    sched = even_schedule(5, 2, 12, 96)
    sharded_train(model, opt, sched, x, y, gs.rank())
    state = model.full_state_dict() if strategy == "zero3" else dict(model.module.state_dict())
    return state, memory_report(model, opt), sched


def _run_all():
    return [_run(s) for s in ("ddp", "zero1", "zero2", "zero3")]


def test_all_strategies_agree_with_one_process():
    x, y = dataset()
    for (state, report, sched), stage in zip(gs.spawn(_run_all, 2)[0], range(4)):
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
