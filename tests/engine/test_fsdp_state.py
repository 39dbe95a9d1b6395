"""FullyShardedDataParallel loads a consolidated state dict (pretrained weights, one
process's checkpoint) with ``load_state_dict``: every rank slices its own shards.

Checked on 3 ranks (uneven shards, padding) for a model with BatchNorm buffers and
for tied weights: after loading, ``full_state_dict()`` is the loaded dict bit for
bit, and a training step from it equals one process's from the same weights;
missing, unexpected and mis-shaped keys are named; a non-strict partial load
changes only what it names.
"""

import pytest
import torch
from torch import nn

import gradsync as gs
from tests.helpers import D_IN, SharedSpawn, Tied, mse


def _bn(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 10), nn.BatchNorm1d(10), nn.Tanh(),
                         nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)).double()


def _tied(seed):
    m = Tied()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


FACTORIES = {"bn": _bn, "tied": _tied}


def _pretrained(name):
    """Weights (and, for BatchNorm, running statistics) that are not the wrapped init."""
    m = FACTORIES[name](11)
    if name == "bn":
        m.train()
        m(torch.randn(16, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    return {k: v.clone() for k, v in m.state_dict().items()}


def _batch():
    g = torch.Generator().manual_seed(9)
    return (torch.randn(12, D_IN, generator=g, dtype=torch.float64),
            torch.randn(12, 3, generator=g, dtype=torch.float64))


def _copy(sd):
    return {k: v.clone() for k, v in sd.items()}  # buffers are returned by reference


def _job(name):
    sd = _pretrained(name)
    model = gs.FullyShardedDataParallel(FACTORIES[name](0), wrap={nn.Linear})
    before = _copy(model.full_state_dict())
    out = {"missing": None, "shape": None}
    try:
        model.load_state_dict({k: v for k, v in sd.items() if k != list(sd)[-1]})
    except RuntimeError as e:
        out["missing"] = str(e)
    bad = dict(sd)
    key = next(k for k, v in sd.items() if v.ndim == 2)
    bad[key] = torch.zeros(1, 1, dtype=torch.float64)
    try:
        model.load_state_dict(bad)
    except RuntimeError as e:
        out["shape"] = str(e)
    out["unchanged_after_errors"] = all(torch.equal(before[k], v)
                                        for k, v in model.full_state_dict().items())
    model.load_state_dict(sd)
    out["loaded"] = _copy(model.full_state_dict())
    x, y = _batch()
    rank, world = gs.rank(), gs.world_size()
    lo, hi = rank * 12 // world, (rank + 1) * 12 // world
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()  # BatchNorm from its loaded statistics (batch statistics are per rank)
    model.backward(mse(model(x[lo:hi]), y[lo:hi]), num_items=hi - lo)
    opt.step()
    out["stepped"] = model.full_state_dict()
    first = next(k for k, v in sd.items() if v.ndim == 2)
    fresh = gs.FullyShardedDataParallel(FACTORIES[name](0), wrap={nn.Linear})
    init = _copy(fresh.full_state_dict())
    missing, unexpected = fresh.load_state_dict({first: sd[first]}, strict=False)
    out["partial"] = {"state": fresh.full_state_dict(), "init": init, "missing": len(missing),
                      "unexpected": unexpected}
    return out


NAMES = tuple(FACTORIES)
SPAWN = SharedSpawn({n: (_job, (n,)) for n in NAMES}, timeout_s=120)


@pytest.mark.parametrize("name", NAMES)
def test_consolidated_state_dict_loads_into_shards(name):
    sd = _pretrained(name)
    ref = FACTORIES[name](0)
    ref.load_state_dict(sd)
    x, y = _batch()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref.eval()
    mse(ref(x), y).backward()
    opt.step()
    first = next(k for k, v in sd.items() if v.ndim == 2)
    for out in SPAWN.results(name, 3):
        assert out["missing"] and "missing" in out["missing"], out
        assert repr(list(sd)[-1]) in out["missing"]
        assert "shape [1, 1] in the state dict" in out["shape"]
        assert out["unchanged_after_errors"] is True
        assert out["loaded"].keys() == sd.keys()
        bad = [k for k, v in sd.items() if not torch.equal(out["loaded"][k], v)]
        assert not bad, (bad, [(out["loaded"][k] - sd[k]).abs().max() for k in bad])
        gap = max(float((out["stepped"][k] - v).abs().max())
                  for k, v in ref.state_dict().items())
        assert gap <= 1e-12, gap
        partial, init = out["partial"]["state"], out["partial"]["init"]
        assert out["partial"]["unexpected"] == []
        assert out["partial"]["missing"] == len(sd) - 1 - (name == "tied")
        assert list(partial) == list(sd)
        for k in sd:
            want = sd[k] if k == first or (name == "tied" and k == "dec.weight") else init[k]
            assert torch.equal(partial[k], want), k
