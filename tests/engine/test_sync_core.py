"""The synchronised-backward core's corners, against one process on the whole batch.

Rule 5 with a graph: a rank whose micro-batch is empty but which ran the forward
passes its loss with ``num_items=0``; collectives inside the graph (SyncBatchNorm's
backward) must run there too, and a NaN loss (a mean over nothing, or a token
loss whose labels are all ignored) must not reach the window's gradients. And a
pass no parameter joins issues no collective at all.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync as gs
from gradsync.engine.transport import comm
from tests.helpers import SharedSpawn, job_table, max_gap

KINDS = ("ddp", "zero2", "zero3")


class BNNet(nn.Module):
    def __init__(self, sync: bool):
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(4, 6)
        self.norm = gs.SyncBatchNorm(6) if sync else nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 5)
        self.double()

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _data():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (40,), generator=g)
    return x, y


# step -> micro-step -> rank -> (rows, labels ignored?)
SCHEDULE = [
    [[(0, 6, False), (6, 9, False)], [(9, 13, False), (13, 13, False)]],  # empty batch
    [[(13, 16, False), (16, 22, False)], [(22, 25, True), (25, 28, False)]],  # all ignored
    [[(28, 28, False), (28, 33, False)], [(33, 36, False), (36, 40, False)]],
]


def _loss(logits, y, ignored):
    y = torch.full_like(y, -100) if ignored else y
    return F.cross_entropy(logits, y, ignore_index=-100)  # NaN when nothing counts


def _wrap(kind, module):
    if kind == "zero3":
        model = gs.FullyShardedDataParallel(module, wrap={nn.Linear})
        return model, torch.optim.SGD(model.parameters(), lr=0.3)
    model = gs.DataParallel(module)
    if kind == "zero2":
        return model, gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.3)
    return model, torch.optim.SGD(model.parameters(), lr=0.3)


def _train(kind, schedule=SCHEDULE):
    x, y = _data()
    model, opt = _wrap(kind, BNNet(sync=True))
    for step in schedule:
        for k, micro in enumerate(step):
            lo, hi, ignored = micro[gs.rank()]
            with model.no_sync() if k < len(step) - 1 else contextlib.nullcontext():
                loss = _loss(model(x[lo:hi]), y[lo:hi], ignored)
                n = 0 if ignored else hi - lo
                model.backward(loss, num_items=n)  # forward always runs, even when empty
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict() if kind == "zero3" else model.module.state_dict()
    return {k: v.clone() for k, v in state.items()}


def _reference(schedule=SCHEDULE):
    """One process: BatchNorm over each micro-step's whole batch, loss over all items."""
    x, y = _data()
    model = BNNet(sync=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in schedule:
        total = sum(hi - lo for micro in step for lo, hi, ign in micro if not ign)
        for micro in step:
            idx = [i for lo, hi, _ in micro for i in range(lo, hi)]
            keep = torch.tensor([not ign for lo, hi, ign in micro for _ in range(lo, hi)])
            logits = model(x[idx])
            losses = F.cross_entropy(logits, y[idx], reduction="none")
            (losses[keep].sum() / total).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _masked_loss(logits, y, ignored):
    """Sum over kept tokens / their count: 0/0 and a NaN gradient when none is kept."""
    keep = torch.zeros(len(y)) if ignored else torch.ones(len(y))
    return (F.cross_entropy(logits, y, reduction="none") * keep).sum() / keep.sum()


def _nan_train(kind):
    """No coupling between rows: a rank whose tokens are all masked gets NaN gradients
    from 0/0, which must count as zero and leave the window's gradients alone."""
    x, y = _data()
    torch.manual_seed(6)
    model, opt = _wrap(kind, nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double())
    for step in SCHEDULE:
        for k, micro in enumerate(step):
            lo, hi, ignored = micro[gs.rank()]
            with model.no_sync() if k < len(step) - 1 else contextlib.nullcontext():
                loss = _masked_loss(model(x[lo:hi]), y[lo:hi], ignored or hi == lo)
                model.backward(loss, num_items=0 if ignored else hi - lo)
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict() if kind == "zero3" else model.module.state_dict()
    return {k: v.clone() for k, v in state.items()}


def _nan_reference():
    x, y = _data()
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in SCHEDULE:
        idx = [i for micro in step for lo, hi, ign in micro if not ign for i in range(lo, hi)]
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _no_param_pass():
    x, _ = _data()
    model = gs.DataParallel(BNNet(sync=False))
    events = []
    inp = x[:4].clone().requires_grad_(True)
    out = model(inp)
    with comm.add_observer(lambda k, ev: events.append(ev.tag) if k == "launch" else None):
        (g,) = torch.autograd.grad(out.sum(), inp, create_graph=True)
        during = list(events)
        model.backward((out ** 2).mean() + (g ** 2).mean(), num_items=4)
    return {"during_grad": during, "after_backward": events[len(during):]}


JOBS = job_table(*[(f"sync_batchnorm/{k}", _train, (k,)) for k in KINDS],
                 ("no_param_pass", _no_param_pass, ()),
                 *[(f"nan/{k}", _nan_train, (k,)) for k in KINDS])
SPAWN = SharedSpawn(JOBS)


def _results(name):
    return SPAWN.results(name, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_and_all_ignored_micro_batches_with_sync_batchnorm_match_one_process(kind):
    results = _results(f"sync_batchnorm/{kind}")
    ref = _reference()
    assert list(results[0]) == list(ref)
    for name, value in ref.items():
        assert max_gap([results[0][name].double()], [value.double()]) <= 1e-12, name
        assert torch.equal(results[0][name], results[1][name]), name


def test_a_pass_no_parameter_joins_issues_no_collective():
    for res in _results("no_param_pass"):
        assert res["during_grad"] == []  # the buffer broadcast happened at the forward, before
        assert any(t.startswith("bucket") for t in res["after_backward"]), res


@pytest.mark.parametrize("kind", KINDS)
def test_nan_from_a_rank_with_nothing_to_count_never_reaches_the_gradients(kind):
    results = _results(f"nan/{kind}")
    ref = _nan_reference()
    assert list(results[0]) == list(ref)
    for name, value in ref.items():
        assert max_gap([results[0][name]], [value]) <= 1e-12, name
        assert torch.equal(results[0][name], results[1][name]), name
