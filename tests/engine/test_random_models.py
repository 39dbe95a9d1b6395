"""A seeded sweep of random models and loops, every strategy against one process (float64).

Hand-written tests check one corner each; this one crosses them, the way a user's
model and loop combine them: layer widths down to 1, a weight reused outside its
module (``h @ layer.weight``), a frozen layer, a conv in front, branches each rank
takes or skips per micro-step (``find_unused_parameters=True``), uneven micro-batch
sizes with ``num_items``, accumulation under ``no_sync``, SGD-momentum or AdamW,
``zero_grad(set_to_none=False)``, gradient clipping, tiny or default buckets, stage 3
with or without units. Each configuration is trained on DataParallel, ZeRO-1/2 or
stage 3 by 2 or 3 ranks and compared with one process taking the same steps on the
union of the ranks' micro-batches.

The sweep found three bugs, each now also tested where it lives: stage 3 computing
with uninitialised memory when a unit's weight was used outside its forward
(``cpu @ meta``), ZeRO skipping a parameter with a zeroed gradient, and stage 3
carrying a unit's old gradient into the next step.

Tolerances: 1e-12 with SGD; 1e-7 with AdamW, whose division by sqrt(v) + eps
amplifies last-bit differences where v is tiny (a width-1 layer's).
"""

from __future__ import annotations

import contextlib
import functools
import random

import pytest
import torch
from torch import nn

import gradsync as gs

KINDS = ("ddp", "zero1", "zero2", "fsdp")


class RandomNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        widths = cfg["widths"]
        self.conv = nn.Conv1d(1, 2, 3, padding=1) if cfg["conv"] else None
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-2], widths[1:-1]))
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(widths[-2], widths[-2]), nn.Tanh())
                                      for _ in range(cfg["branches"]))
        self.norm = nn.LayerNorm(widths[-2])
        self.head = nn.Linear(widths[-2], widths[-1])
        self.reuse = cfg["reuse"]
        if cfg["frozen"] and len(self.layers) > 1:
            self.layers[1].requires_grad_(False)

    def forward(self, x, branches):
        if self.conv is not None:
            x = x + self.conv(x.unsqueeze(1)).mean(1)
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i == 0 and self.reuse:  # the first weight again, outside its module
                h = h + 0.1 * torch.tanh(h @ self.layers[0].weight).sum(-1, keepdim=True)
        for b in branches:
            h = h + self.branches[b](h)
        return self.head(self.norm(h))


def make_config(rng: random.Random) -> dict:
    d = rng.choice([3, 5, 8])
    kind = rng.choice(KINDS)
    wrap = kind == "fsdp" and rng.random() < 0.5
    return {
        "seed": rng.randint(0, 10**6), "kind": kind, "wrap": wrap,
        "widths": [d] + [rng.choice([1, 4, 7, 16]) for _ in range(rng.randint(1, 3))]
                  + [rng.choice([1, 2, 5])],
        "conv": rng.random() < 0.3, "frozen": rng.random() < 0.3,
        "reuse": rng.random() < 0.4 and not wrap,  # stage 3 refuses it (test_fsdp_units)
        "branches": rng.randint(0, 3), "per_rank_branches": not wrap,  # units: same on all
        "opt": rng.choice(["sgd", "adamw"]), "steps": rng.randint(2, 4),
        "accum": rng.randint(1, 3), "cap": rng.choice([1e-5, 1e-4, 25]),
        "set_to_none": rng.random() < 0.6, "clip": rng.random() < 0.3,
    }


def build(cfg):
    torch.manual_seed(cfg["seed"] % 10**4)
    return RandomNet(cfg).double()


def micro_batch(cfg, rank, step, k):
    g = torch.Generator().manual_seed(cfg["seed"] + 1000 * step + 10 * rank + k)
    n = 1 + (3 * rank + step + 2 * k) % 4
    width_in, width_out = cfg["widths"][0], cfg["widths"][-1]
    return (torch.randn(n, width_in, generator=g, dtype=torch.float64),
            torch.randn(n, width_out, generator=g, dtype=torch.float64))


def branches(cfg, rank, step, k):
    rng = random.Random(cfg["seed"] + 7 * step + 3 * k + (31 * rank if cfg["per_rank_branches"]
                                                          else 0))
    n = cfg["branches"]
    return sorted(rng.sample(range(n), rng.randint(0, n)))


def optimizer(cfg, params):
    if cfg["opt"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference(cfg, world):
    model = build(cfg)
    opt = optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    for step in range(cfg["steps"]):
        total, n = 0.0, 0
        for rank in range(world):
            for k in range(cfg["accum"]):
                x, y = micro_batch(cfg, rank, step, k)
                total = total + ((model(x, branches(cfg, rank, step, k)) - y) ** 2).sum()
                n += len(x)
        (total / n).backward()
        if cfg["clip"]:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                           0.3)
        opt.step()
        opt.zero_grad(set_to_none=cfg["set_to_none"])
    return {k: v.clone() for k, v in model.state_dict().items()}


def distributed(cfg):
    rank, module = gs.rank(), build(cfg)
    if cfg["kind"] == "fsdp":
        model = gs.FullyShardedDataParallel(module, wrap={nn.Sequential} if cfg["wrap"] else None,
                                            find_unused_parameters=True)
        opt = optimizer(cfg, model.parameters())
        clip = model.clip_grad_norm_
    else:
        model = gs.DataParallel(module, bucket_cap_mb=cfg["cap"], first_bucket_mb=cfg["cap"],
                                find_unused_parameters=True)
        if cfg["kind"] == "ddp":
            opt = optimizer(cfg, [p for p in module.parameters() if p.requires_grad])
            clip = functools.partial(gs.clip_grad_norm_, model)  # whole gradients: torch's
        else:
            cls, kw = ((torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}) if cfg["opt"] == "sgd"
                       else (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}))
            opt = gs.ZeroOptimizer(model, cls, stage=int(cfg["kind"][-1]), **kw)
            clip = opt.clip_grad_norm_
    for step in range(cfg["steps"]):
        for k in range(cfg["accum"]):
            x, y = micro_batch(cfg, rank, step, k)
            last = k == cfg["accum"] - 1
            with contextlib.nullcontext() if last else model.no_sync():
                out = model(x, branches(cfg, rank, step, k))
                model.backward(((out - y) ** 2).sum(-1).mean(), num_items=len(x))
        if cfg["clip"]:
            clip(0.3)
        opt.step()
        opt.zero_grad(set_to_none=cfg["set_to_none"])
    state = model.full_state_dict() if cfg["kind"] == "fsdp" else module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def sweep(configs):
    torch.set_num_threads(1)
    return [{"config": cfg, "state": distributed(cfg)} for cfg in configs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,seed", [(2, 11), (3, 12)])
def test_random_models_train_as_one_process_on_every_strategy(world, seed):
    rng = random.Random(seed)
    configs = [make_config(rng) for _ in range(16)]
    results = gs.spawn(sweep, world, configs, timeout_s=240)
    assert [[run["config"] for run in rank] for rank in results] == [configs] * world
    failures = []
    for i, cfg in enumerate(configs):
        want = reference(cfg, world)
        tol = 1e-12 if cfg["opt"] == "sgd" else 1e-7
        for rank in range(world):
            got = results[rank][i]["state"]
            assert list(got) == list(want), (i, rank)
            gap = max((float((want[k] - got[k]).abs().max()) for k in want if want[k].numel()),
                      default=0.0)
            if not gap <= tol:
                failures.append(f"config {i} rank {rank}: gap {gap:.3e} {cfg}")
            assert all(torch.equal(got[k], results[0][i]["state"][k]) for k in got), (i, rank)
    assert not failures, "\n".join(failures)
