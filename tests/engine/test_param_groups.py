"""Optimizer parameter groups by name on every strategy, against one process, in float64.

The GPT-2 / nanoGPT recipe: weight decay on matrices, none on biases and norm
weights, here also a different learning rate per group. DataParallel
(``model.param_groups``), ZeroOptimizer stages 1 and 2 (``param_groups=``) and
FullyShardedDataParallel (``model.param_groups``) must train exactly as one
process with the same torch groups on the whole batch. Tiny buckets and units
split parameters across ranks, so some ranks hold no piece of some parameters.
Also with a parameter left out of every group (not stepped, its gradient never
zeroed by the optimizer): stage 3 once carried the whole unit's old gradient into
the next step when one piece of it still held a gradient.
"""

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError
from tests.helpers import SHARDED_TOL, SharedSpawn, job_table, mse

STEPS = 4
WORLD = 2


def _model():
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 12),
                      nn.Tanh(), nn.Linear(12, 4))
    return m.double()


def _groups(module, objects=True, omit=False):
    """Objects work where the wrapper keeps the module's parameters (not stage 3, whose
    module has none after wrapping: names are taken before). ``omit``: the last bias
    in no group."""
    decay = [n for n, p in module.named_parameters() if p.ndim >= 2]
    rest = [p if objects else n for n, p in module.named_parameters() if p.ndim < 2]
    rest = rest[:-1] if omit else rest
    return [{"params": decay, "weight_decay": 0.2},
            {"params": rest, "weight_decay": 0.0, "lr": 0.05}]


def _data():
    torch.manual_seed(4)
    x = torch.randn(16 * STEPS, 8, dtype=torch.float64)
    y = torch.randn(16 * STEPS, 4, dtype=torch.float64)
    return x, y


def _train(kind, omit=False):
    x, y = _data()
    module = _model()
    rank, world = gs.rank(), gs.world_size()
    if kind == "fsdp":
        groups = _groups(module, objects=False, omit=omit)
        model = gs.FullyShardedDataParallel(module, wrap={nn.Linear})
        opt = torch.optim.AdamW(model.param_groups(groups), lr=0.02)
    else:
        model = gs.DataParallel(module, bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
        if kind == "dp":
            opt = torch.optim.AdamW(model.param_groups(_groups(module, omit=omit)), lr=0.02)
        else:
            opt = gs.ZeroOptimizer(model, torch.optim.AdamW, stage=int(kind[-1]),
                                   param_groups=_groups(module, omit=omit), lr=0.02)
    for step in range(STEPS):
        xb, yb = x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16]
        lo, hi = rank * 16 // world, (rank + 1) * 16 // world
        model.backward(mse(model(xb[lo:hi]), yb[lo:hi]), num_items=hi - lo)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = model.full_state_dict() if kind == "fsdp" else module.state_dict()
    return {"state": {k: v.detach().clone() for k, v in state.items()},
            "groups": len(opt.param_groups)}


def _errors():
    module = _model()
    model = gs.DataParallel(module)
    out = {}
    for case, groups in (("unknown", [{"params": ["0.weight", "nope"]}]),
                         ("twice", [{"params": ["0.weight"]}, {"params": ["0.weight"]}]),
                         ("foreign", [{"params": [torch.zeros(2)]}]),
                         ("not_a_list", {"params": ["0.weight"]}),
                         ("nothing", [{"params": []}])):
        try:
            gs.ZeroOptimizer(model, torch.optim.AdamW, stage=1, param_groups=groups)
            out[case] = None
        except UsageError as e:
            out[case] = str(e)
    return out


KINDS = ("dp", "zero1", "zero2", "fsdp")


JOBS = job_table(*[(f"{k}/all", _train, (k,)) for k in KINDS],
                 *[(f"{k}/one-left-out", _train, (k, True)) for k in KINDS],
                 ("errors", _errors, ()))


SPAWN = SharedSpawn(JOBS, timeout_s=120)


def _results(name):
    return SPAWN.results(name, WORLD)


def _reference(omit=False):
    x, y = _data()
    module = _model()
    by_name = dict(module.named_parameters())
    torch_groups = [{**g, "params": [by_name[p] if isinstance(p, str) else p for p in g["params"]]}
                    for g in _groups(module, omit=omit)]
    opt = torch.optim.AdamW(torch_groups, lr=0.02)
    for step in range(STEPS):
        mse(module(x[step * 16:(step + 1) * 16]), y[step * 16:(step + 1) * 16]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return module.state_dict()


@pytest.mark.parametrize("omit", [False, True], ids=["all", "one-left-out"])
@pytest.mark.parametrize("kind", KINDS)
def test_groups_by_name_train_as_one_process(kind, omit):
    ref = _reference(omit)
    results = _results(f"{kind}/{'one-left-out' if omit else 'all'}")
    for rank, res in enumerate(results):
        state = res["state"]
        assert res["groups"] == 2 and list(state) == list(ref)
        gap = max(float((state[k] - v).abs().max()) for k, v in ref.items())
        assert gap <= SHARDED_TOL["adamw"], f"{kind} rank {rank}: {gap:.3e}"
    # the groups matter: without them the result differs by far more than the tolerance
    x, y = _data()
    module = _model()
    opt = torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.2)
    for step in range(STEPS):
        mse(module(x[step * 16:(step + 1) * 16]), y[step * 16:(step + 1) * 16]).backward()
        opt.step()
        opt.zero_grad()
    assert max(float((module.state_dict()[k] - v).abs().max()) for k, v in ref.items()) > 1e-4


def test_bad_groups_are_named_on_every_rank():
    for msgs in _results("errors"):
        assert all(isinstance(m, str) for m in msgs.values()) and len(msgs) == 5, msgs
        assert "names 'nope', which is not a trainable parameter" in msgs["unknown"]
        assert "'0.weight' is in param_groups[0] and param_groups[1]" in msgs["twice"]
        assert "not one of the model's parameters" in msgs["foreign"]
        assert "must be a non-empty list of dicts" in msgs["not_a_list"]
        assert "name no parameter" in msgs["nothing"]
