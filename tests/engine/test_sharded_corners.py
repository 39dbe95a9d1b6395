"""Sharded corners a user hits outside the training step (2 gloo ranks, float64).

* ``gs.clip_grad_norm_(model)`` on a DataParallel whose gradients ZeRO shards clips
  exactly as ``gs.clip_grad_norm_(zero_optimizer)`` (it used to see no gradient and
  return 0); a plain torch optimizer is a one-line error naming what to pass;
* ``ZeroOptimizer.add_param_group`` after construction is a one-line error (the
  shards are fixed; the group would never train);
* under FSDP, a wrapped layer's weight read between steps is a meta tensor of its
  shape (never a view of freed storage, which crashed the process).
"""

from __future__ import annotations

import torch
from torch import nn

import gradsync as gs
from tests.helpers import dataset, job_results, mlp, mse, run_jobs


def _clip(target_is_model: bool):
    x, y = dataset()
    model = gs.DataParallel(mlp())
    opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1)
    norms = []
    for step in range(3):
        idx = slice(8 * step + 4 * gs.rank(), 8 * step + 4 * gs.rank() + 4)
        model.backward(mse(model(x[idx]), y[idx]), num_items=4)
        norms.append(float(gs.clip_grad_norm_(model if target_is_model else opt, 0.05)))
        opt.step()
        opt.zero_grad()
    return norms, [p.detach().clone() for p in model.parameters()]


def _errors():
    out = []
    model = gs.DataParallel(mlp())
    opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    for make in (lambda: opt.add_param_group({"params": [extra]}),
                 lambda: gs.clip_grad_norm_(torch.optim.SGD([extra], lr=0.1), 1.0)):
        try:
            make()
            out.append(None)
        except gs.UsageError as e:
            out.append(str(e))
    return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _fsdp_weight_between_steps():
    torch.manual_seed(0)
    model = gs.FullyShardedDataParallel(nn.Sequential(Block(), Block()).double(),
                                        wrap={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 5, dtype=torch.float64)).pow(2).mean().backward()
    opt.step()
    w = model.module[0].lin.weight
    return w.device.type, tuple(w.shape), repr(w)


_cache: dict = {}


def _results(index):
    if not _cache:
        jobs = [(_clip, (True,)), (_clip, (False,)), (_errors, ()),
                (_fsdp_weight_between_steps, ())]
        _cache["r"] = gs.spawn(run_jobs, 2, jobs, timeout_s=90)
    return job_results(_cache["r"], index)


def test_clip_through_the_model_is_the_zero_optimizers_clip():
    by_model, by_opt = _results(0), _results(1)
    for (n1, p1), (n2, p2) in zip(by_model, by_opt):
        assert n1 == n2 and all(n > 0.05 for n in n1)  # clipping engaged every step
        assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_add_param_group_and_clip_on_an_optimizer_are_one_line_errors():
    for add, clip in _results(2):
        assert add and "add_param_group" in add and "\n" not in add
        assert clip and "pass the model" in clip


def test_fsdp_weight_between_steps_is_a_meta_tensor_of_its_shape():
    for device, shape, text in _results(3):
        assert device == "meta" and shape == (5, 5) and "meta" in text
