"""gs.SyncBatchNorm against one BatchNorm on the whole batch, in float64.

Uneven batches per rank, a rank with 0 samples, 1d (2D and 3D inputs) and 2d
layers, affine or not, exponential and cumulative (``momentum=None``) running
averages: outputs, input gradients, weight/bias gradients (summed over ranks)
and running statistics after every step within 1e-12; one all-gather per
training forward, one all-reduce per backward, nothing in eval; and inside
gs.DataParallel with ``num_items`` and no_sync accumulation, the trained model
equals one process with plain BatchNorm on the whole batch.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.engine.transport import comm
from tests.helpers import D_IN, D_OUT, SharedSpawn, job_table

WORLD, C, TOL = 3, 4, 1e-12
SIZES = {  # samples per rank in each step: uneven, and a rank with none
    "1d": [[5, 0, 3], [2, 4, 1], [3, 3, 0]],
    "1d3": [[2, 3, 1], [0, 2, 2], [1, 1, 3]],
    "2d": [[2, 0, 3], [1, 2, 2], [0, 3, 1]],
}
SHAPES = {"1d": (), "1d3": (5,), "2d": (3, 2)}


def make_bn(kind, affine, momentum):
    torch.manual_seed(3)
    cls = nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d
    bn = cls(C, affine=affine, momentum=momentum).double()
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bn


def batch(kind, step):
    """The step's global batch (offset from zero mean, as real activations are) and dL/dy."""
    g = torch.Generator().manual_seed(100 + 10 * step + len(kind))
    shape = (sum(SIZES[kind][step]), C, *SHAPES[kind])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 3
    return x, torch.randn(shape, generator=g, dtype=torch.float64)


def _record(bn, y, dx, dw, db):
    return {"y": y.detach().clone(), "dx": dx, "dw": dw, "db": db,
            "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone(),
            "tracked": int(bn.num_batches_tracked)}


def reference(kind, affine, momentum):
    bn = make_bn(kind, affine, momentum)
    out = []
    for step in range(len(SIZES[kind])):
        x, proj = batch(kind, step)
        x.requires_grad_(True)
        y = bn(x)
        (y * proj).sum().backward()
        out.append(_record(bn, y, x.grad.clone(), *[None if p is None else p.grad.clone()
                                                    for p in (bn.weight, bn.bias)]))
        bn.zero_grad()
    bn.eval()
    out.append(bn(batch(kind, 0)[0]).detach())
    return out


def module_job(kind, affine, momentum):
    rank = dist.get_rank()
    sync = gs.convert_sync_batchnorm(make_bn(kind, affine, momentum))
    out, ops = [], []
    with comm.add_observer(lambda k, ev: ops.append(ev.op) if k == "launch" else None):
        for step, sizes in enumerate(SIZES[kind]):
            x, proj = batch(kind, step)
            lo = sum(sizes[:rank])
            xr = x[lo:lo + sizes[rank]].clone().requires_grad_(True)
            y = sync(xr)
            (y * proj[lo:lo + sizes[rank]]).sum().backward()
            grads = []
            for p in (sync.weight, sync.bias):
                if p is not None:
                    dist.all_reduce(p.grad)  # what the data-parallel wrapper does (sum)
                grads.append(None if p is None else p.grad.clone())
            out.append(_record(sync, y, xr.grad.clone(), *grads))
            sync.zero_grad()
        training_ops = list(ops)
        ops.clear()
        sync.eval()
        x = batch(kind, 0)[0]
        lo = sum(SIZES[kind][0][:rank])
        out.append(sync(x[lo:lo + SIZES[kind][0][rank]]).detach())
    return {"steps": out, "training_ops": training_ops, "eval_ops": ops}


def _rows(kind, step, rank):
    lo = sum(SIZES[kind][step][:rank])
    return slice(lo, lo + SIZES[kind][step][rank])


CASES = [("1d", True, 0.1), ("1d3", False, None), ("2d", True, None)]


def _case_name(kind, affine, momentum):
    return f"{kind}-affine{affine}-momentum{momentum}"


@pytest.mark.parametrize("kind,affine,momentum", CASES, ids=[_case_name(*c) for c in CASES])
def test_matches_one_batchnorm_on_the_whole_batch(kind, affine, momentum):
    ref = reference(kind, affine, momentum)
    steps = len(SIZES[kind])
    for rank, res in enumerate(_results(_case_name(kind, affine, momentum))):
        got = res["steps"]
        assert len(got) == steps + 1  # every training step, then the evaluation
        assert res["training_ops"] == ["all_gather", "all_reduce"] * steps, res
        assert res["eval_ops"] == []  # running statistics: no communication in eval
        for step in range(steps):
            r, g, rows = ref[step], got[step], _rows(kind, step, rank)
            assert g["tracked"] == r["tracked"] == step + 1
            pairs = [("y", r["y"][rows], g["y"]), ("dx", r["dx"][rows], g["dx"]),
                     ("running_mean", r["running_mean"], g["running_mean"]),
                     ("running_var", r["running_var"], g["running_var"])]
            if affine:
                pairs += [("dw", r["dw"], g["dw"]), ("db", r["db"], g["db"])]
            for name, want, have in pairs:
                assert have.shape == want.shape, (name, step, rank)
                if want.numel():
                    gap = float((want - have).abs().max())
                    assert gap <= TOL, f"{name} step {step} rank {rank}: gap {gap:.3e}"
        want = ref[steps][_rows(kind, 0, rank)]  # eval: the running statistics
        assert got[steps].shape == want.shape
        assert not want.numel() or float((got[steps] - want).abs().max()) <= TOL


# ----------------------------------------------------------------------------- DataParallel
DP_SIZES = [[[3, 2, 4], [1, 3, 2]], [[2, 2, 2], [4, 1, 3]], [[5, 1, 2], [2, 2, 1]]]


def net():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, D_OUT)).double()


def dp_data():
    g = torch.Generator().manual_seed(5)
    n = sum(sum(sum(m) for m in step) for step in DP_SIZES)
    return (torch.randn(n, D_IN, generator=g, dtype=torch.float64) + 1,
            torch.randn(n, D_OUT, generator=g, dtype=torch.float64))


def _micro_rows():
    """[step][micro][rank] -> row indices, consecutive over the whole schedule."""
    out, cursor = [], 0
    for step in DP_SIZES:
        s = []
        for micro in step:
            m = []
            for size in micro:
                m.append(list(range(cursor, cursor + size)))
                cursor += size
            s.append(m)
        out.append(s)
    return out


def dp_job():
    x, y = dp_data()
    dp = gs.DataParallel(gs.convert_sync_batchnorm(net()), bucket_cap_mb=0.0005,
                         first_bucket_mb=0.0005)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for step in _micro_rows():
        for k, micro in enumerate(step):
            idx = micro[dist.get_rank()]
            with dp.no_sync() if k < len(step) - 1 else contextlib.nullcontext():
                dp.backward(((dp(x[idx]) - y[idx]) ** 2).mean(), num_items=len(idx))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in dp.module.state_dict().items()}


def test_inside_data_parallel_equals_one_process_with_batchnorm():
    """Uneven micro-batches under no_sync with num_items: the exact global-batch model."""
    x, y = dp_data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in _micro_rows():
        total = sum(len(r) for micro in step for r in micro)
        for micro in step:
            idx = [i for r in micro for i in r]
            (((model(x[idx]) - y[idx]) ** 2).mean(dim=1).sum() / total).backward()
        opt.step()
        opt.zero_grad()
    ref = model.state_dict()
    for rank, got in enumerate(_results("data_parallel")):
        assert list(got) == list(ref)
        for k in ref:
            gap = float((got[k].double() - ref[k].double()).abs().max())
            assert gap <= TOL, f"rank {rank} {k}: gap {gap:.3e}"


def too_few_job():
    sync = gs.SyncBatchNorm(C).double()
    x = torch.randn(1 if dist.get_rank() == 0 else 0, C, dtype=torch.float64)
    try:
        sync(x)
    except ValueError as e:
        return str(e)
    return None


def test_one_value_per_channel_over_all_ranks_is_an_error_on_every_rank():
    messages = _results("too_few")
    assert all(m and "more than 1 value per channel" in m and "got 1 over all ranks" in m
               for m in messages), messages


JOBS = job_table(*[(_case_name(*c), module_job, c) for c in CASES],
                 ("data_parallel", dp_job, ()), ("too_few", too_few_job, ()))
SPAWN = SharedSpawn(JOBS)


def _results(name):
    return SPAWN.results(name, WORLD)


# ----------------------------------------------------------------------------- one process
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(2, C, 1), nn.BatchNorm2d(C))
        self.head = nn.BatchNorm1d(C, affine=False, momentum=None)


def test_convert_replaces_every_batchnorm_and_keeps_its_tensors():
    model = Nested().double().eval()
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    converted = gs.convert_sync_batchnorm(model)
    assert converted is model
    assert isinstance(model.features[1], gs.SyncBatchNorm)
    assert isinstance(model.head, gs.SyncBatchNorm) and model.head.momentum is None
    assert not model.head.affine and not model.features[1].training
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    root = gs.convert_sync_batchnorm(nn.BatchNorm3d(C))
    assert isinstance(root, gs.SyncBatchNorm)
    # torch's spellings: the classmethod, process_group=, and torch's own SyncBatchNorm
    torch_sync = nn.SyncBatchNorm.convert_sync_batchnorm(Nested())
    ours = gs.SyncBatchNorm.convert_sync_batchnorm(torch_sync, process_group=None)
    assert isinstance(ours.features[1], gs.SyncBatchNorm) and isinstance(ours.head,
                                                                        gs.SyncBatchNorm)
    assert gs.SyncBatchNorm(C, process_group="g").group == "g"


def test_without_a_process_group_it_is_batchnorm():
    """As torch's SyncBatchNorm: no group (or a group of one) means local statistics."""
    torch.manual_seed(6)
    bn = nn.BatchNorm2d(C).double()
    sync = gs.convert_sync_batchnorm(copy.deepcopy(bn))
    x = torch.randn(4, C, 3, 3, dtype=torch.float64)
    for _ in range(2):
        assert torch.equal(bn(x), sync(x))
    assert torch.equal(bn.running_var, sync.running_var)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        sync(torch.randn(C, dtype=torch.float64))
