"""``model.clip_grad_norm_`` (torch FSDP's method) and ``ZeroOptimizer.clip_grad_norm_``
clip by the global norm over every shard, as one process does on the whole batch.

The limit is far below the norm, so every step clips; a per-shard norm would clip
each rank by a different, smaller norm and miss by far more than the tolerance.
"""

import pytest
import torch
from torch import nn

import gradsync as gs
from tests.helpers import SharedSpawn, mse

STEPS, MAX_NORM = 3, 0.05


def _model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def _data():
    g = torch.Generator().manual_seed(6)
    return (torch.randn(8 * STEPS, 6, generator=g, dtype=torch.float64),
            torch.randn(8 * STEPS, 3, generator=g, dtype=torch.float64))


def _train(kind):
    x, y = _data()
    module = _model()
    if kind == "fsdp":
        model = gs.FullyShardedDataParallel(module, wrap={nn.Linear})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        clip = model.clip_grad_norm_
    else:
        model = gs.DataParallel(module, bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
        opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=int(kind[-1]), lr=0.1)
        clip = opt.clip_grad_norm_
    rank, world, norms = gs.rank(), gs.world_size(), []
    for step in range(STEPS):
        xb, yb = x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8]
        lo, hi = rank * 8 // world, (rank + 1) * 8 // world
        model.backward(mse(model(xb[lo:hi]), yb[lo:hi]), num_items=hi - lo)
        norms.append(float(clip(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict() if kind == "fsdp" else module.state_dict()
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in state.items()}}


KINDS = ("zero1", "zero2", "fsdp")
SPAWN = SharedSpawn({k: (_train, (k,)) for k in KINDS}, timeout_s=120)


def _reference():
    x, y = _data()
    module = _model()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    norms = []
    for step in range(STEPS):
        mse(module(x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms, module.state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_clip_method_uses_the_global_norm(kind):
    ref_norms, ref_state = _reference()
    assert min(ref_norms) > 10 * MAX_NORM  # every step clips
    for res in SPAWN.results(kind, 3):
        norms, state = res["norms"], res["state"]
        assert len(norms) == len(ref_norms) == STEPS and list(state) == list(ref_state)
        assert max(abs(a - b) for a, b in zip(norms, ref_norms)) <= 1e-12
        assert max(float((state[k] - v).abs().max()) for k, v in ref_state.items()) <= 1e-12
