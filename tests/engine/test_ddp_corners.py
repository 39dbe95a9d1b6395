"""Corners a switching DDP user hits, each trained side by side with torch DDP (float64).

Every scenario runs the same steps on a gradsync DataParallel and on torch's
DistributedDataParallel (2 gloo ranks, the same data) and compares parameters and
gradients (<= 1e-12), or checks what DDP does:

* the first gradient of a backward is averaged even when the pass starts at a
  parameter (one used only in the loss, outside forward) and the output is a
  dataclass;
* a backward through ``model.module`` (no forward through the wrapper) stays local,
  on one rank only, without a hang;
* two forwards before one backward with BatchNorm (the buffer broadcast must not
  bump the version autograd saved);
* ``zero_grad(set_to_none=False)``: a parameter no rank used keeps its zero gradient
  (AdamW then decays it, as under DDP);
* a wrapper inside a parent module: the parent's state_dict round trip;
* ``copy.deepcopy`` of the wrapper, and one pickled and loaded (``torch.save``),
  synchronise like the original; ``zero_grad()`` sets gradients to None, as torch's;
* ``zero_grad(set_to_none=False)`` under ZeroOptimizer (stages 1 and 2) keeps zero
  gradients like DDP's ``.grad`` tensors: the unused branch is stepped the same;
* a checkpoint torch DDP saved (``module.`` keys) loads into DataParallel and into
  FullyShardedDataParallel, and the next steps match DDP's; the caller's dict is
  not renamed, and a module whose own child is named ``module`` is left alone.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync as gs
from tests.helpers import SharedSpawn, job_table

TOL = 1e-12


def _batch(step, rank, n=6, d=4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, d, generator=g, dtype=torch.float64)


def _record(model):
    return {n: (p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


@dataclasses.dataclass
class Out:
    mean: torch.Tensor
    extra: torch.Tensor


class Heteroscedastic(nn.Module):
    """Dataclass output; ``log_var`` is used only in the loss, outside forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.log_var = nn.Parameter(torch.zeros(2))
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return Out(self.b(h), h)


def _loss_only_param(wrap):
    model = wrap(Heteroscedastic())
    module = model.module
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        out = model(_batch(step, gs.rank()))
        lv = module.log_var
        loss = (0.5 * torch.exp(-lv) * out.mean.pow(2) + 0.5 * lv).mean() + out.extra.mean()
        loss.backward()
        rec = _record(module)
        opt.step()
        opt.zero_grad()
    return rec


def _module_called_directly(wrap):
    """Rank 0 alone backpropagates through ``model.module`` (a saliency map), then both
    train a step."""
    torch.manual_seed(1)
    model = wrap(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if gs.rank() == 0:
        x = _batch(9, 0).requires_grad_(True)
        model.module(x).sum().backward()
        opt.zero_grad()
    model(_batch(0, gs.rank())).pow(2).mean().backward()
    rec = _record(model.module)
    opt.step()
    return rec


def _two_forwards_one_backward(wrap):
    torch.manual_seed(2)
    model = wrap(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(),
                               nn.Linear(6, 2)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        a = model(_batch(step, gs.rank()))
        b = model(_batch(step + 50, gs.rank()))
        (a - b).pow(2).mean().backward()
        rec = _record(model.module)
        opt.step()
        opt.zero_grad()
    rec["buffers"] = [b.clone() for b in model.module.buffers()]
    return rec


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.double()

    def forward(self, x, use_branch):
        h = self.trunk(x)
        return self.branch(h) if use_branch else h


def _unused_with_zeroed_grads(wrap):
    model = wrap(Branchy(), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(4):
        model(_batch(step, gs.rank()), step == 0).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _record(model.module)


def _unused_with_zeroed_grads_zero(stage):
    """The same under ZeroOptimizer: ``zero_grad(set_to_none=False)`` keeps zeroed
    gradient shards, so the branch no rank uses after step 0 keeps decaying (before,
    its gradient became None and it stood still, unlike DDP)."""
    model = _gs(Branchy(), find_unused_parameters=True)
    opt = gs.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=0.05, weight_decay=0.1)
    for step in range(4):
        model(_batch(step, gs.rank()), step == 0).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {n: (p.detach().clone(), None) for n, p in model.module.named_parameters()}


def _gs(module, **kw):
    return gs.DataParallel(module, bucket_cap_mb=1e-4, **kw)


def _ddp(module, **kw):
    return DDP(module, **kw)


SCENARIOS = [_loss_only_param, _module_called_directly, _two_forwards_one_backward,
             _unused_with_zeroed_grads]


def _wrapper_semantics():
    """A parent's state_dict round trip, deepcopy, pickling, zero_grad's default."""
    torch.manual_seed(4)
    model = gs.DataParallel(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double())
    parent = nn.ModuleDict({"net": model, "head": nn.Linear(3, 1).double()})
    saved = parent.state_dict()
    with torch.no_grad():
        for p in parent.parameters():
            p.add_(1.0)
    parent.load_state_dict(saved)
    restored = all(torch.equal(saved[k], v) for k, v in parent.state_dict().items())
    twin = copy.deepcopy(model)
    twin(_batch(0, gs.rank())).pow(2).mean().backward()
    twin_grads = [p.grad.clone() for p in twin.parameters()]
    buf = io.BytesIO()
    torch.save(model, buf)  # as torch DDP: the module and settings, rewrapped on loading
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded(_batch(0, gs.rank())).pow(2).mean().backward()
    pickled = (type(loaded).__name__, [p.grad.clone() for p in loaded.parameters()])
    model(_batch(0, gs.rank())).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    cleared = all(p.grad is None for p in model.parameters())
    return {"restored": restored, "twin_grads": twin_grads, "grads": grads,
            "pickled_type": pickled[0], "pickled_grads": pickled[1], "cleared": cleared}


def _bn_net():
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, 2)).double()


def _ddp_checkpoint_loads():
    """Two DDP steps, DDP's state_dict saved; a fresh gradsync wrapper (other seed)
    loads it and both go on for two more steps: the same parameters as DDP's."""
    def steps(model, first):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(first, first + 2):
            model(_batch(step, gs.rank())).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(5)
    ddp = DDP(_bn_net())
    steps(ddp, 0)
    saved = ddp.state_dict()
    keys_before = list(saved)
    torch.manual_seed(6)
    ours = {"dp": gs.DataParallel(_bn_net()), "fsdp": gs.FullyShardedDataParallel(_bn_net())}
    for model in ours.values():
        model.load_state_dict(saved)
    steps(ddp, 2)
    for model in ours.values():
        steps(model, 2)
    want = {k[len("module."):]: v for k, v in ddp.state_dict().items()}
    got = {"dp": ours["dp"].state_dict(), "fsdp": ours["fsdp"].full_state_dict()}
    gaps = {name: max(float((sd[k] - want[k]).abs().max()) for k in want)
            for name, sd in got.items()}
    holder = nn.ModuleDict({"module": nn.Linear(2, 2)})  # its own keys start "module."
    wrapped = gs.DataParallel(holder)
    wrapped.load_state_dict(holder.state_dict())
    with pytest.raises(RuntimeError, match="Missing key"):
        wrapped.load_state_dict({k[len("module."):]: v for k, v in holder.state_dict().items()})
    return {"gaps": gaps, "callers_keys_kept": list(saved) == keys_before}


JOBS = job_table(
    *[(f"{fn.__name__}/{side}", fn, (wrap,)) for fn in SCENARIOS
      for side, wrap in (("gradsync", _gs), ("torch", _ddp))],
    ("wrapper_semantics", _wrapper_semantics, ()),
    ("ddp_checkpoint_loads", _ddp_checkpoint_loads, ()),
    *[(f"zeroed_grads_zero/stage{k}", _unused_with_zeroed_grads_zero, (k,)) for k in (1, 2)])
SPAWN = SharedSpawn(JOBS, timeout_s=90)


def _results(name):
    return SPAWN.results(name, 2)


def _gap(a, b):
    if torch.is_tensor(a):
        return float((a - b).abs().max()) if a.numel() else 0.0
    if a is None or b is None:
        assert a is None and b is None, "one gradient is None, the other not"
        return 0.0
    if isinstance(a, dict):
        assert a.keys() == b.keys() and a, (list(a), list(b))
        return max(_gap(a[k], b[k]) for k in a)
    assert len(a) == len(b), f"{len(a)} entries against {len(b)}"
    return max((_gap(x, y) for x, y in zip(a, b)), default=0.0)


@pytest.mark.parametrize("scenario", [f.__name__ for f in SCENARIOS])
def test_same_parameters_and_gradients_as_torch_ddp(scenario):
    ours, theirs = _results(f"{scenario}/gradsync"), _results(f"{scenario}/torch")
    for rank in range(2):
        gap = _gap(ours[rank], theirs[rank])
        assert gap <= TOL, f"rank {rank}: {gap:.3e}"


def test_wrapper_in_a_parent_deepcopy_pickle_and_zero_grad():
    ranks = _results("wrapper_semantics")
    for res in ranks:
        assert res["restored"] is True
        assert res["grads"] and len(res["grads"]) == 4  # Linear and BatchNorm weight, bias
        assert _gap(res["twin_grads"], res["grads"]) == 0.0  # the copy's backward synchronises
        assert res["pickled_type"] == "DataParallel"
        assert _gap(res["pickled_grads"], res["grads"]) == 0.0  # so does the loaded wrapper
        assert res["cleared"] is True
    # the same averaged gradient on both ranks
    assert _gap(ranks[0]["twin_grads"], ranks[1]["twin_grads"]) == 0.0


def test_a_torch_ddp_checkpoint_loads_and_training_continues_as_ddp():
    for res in _results("ddp_checkpoint_loads"):
        gaps = res["gaps"]
        assert list(gaps) == ["dp", "fsdp"] and gaps["dp"] <= TOL and gaps["fsdp"] <= TOL, gaps
        assert res["callers_keys_kept"] is True  # the caller's dict keeps its keys


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_keeping_zeros_under_zero_steps_unused_parameters_as_ddp(stage):
    theirs = _results("_unused_with_zeroed_grads/torch")
    ours = _results(f"zeroed_grads_zero/stage{stage}")
    for rank in range(2):
        params = {n: (v[0], None) for n, v in theirs[rank].items()}
        assert _gap(ours[rank], params) <= 1e-12, rank
