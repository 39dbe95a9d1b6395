"""DiLoCo set-ups, the worker and single-process references shared by ``test_diloco*.py``.

The references are the algorithms as the papers write them: synchronous SGD on each
step's global batch, and K workers in one process with item-weighted outer steps
(Streaming DiLoCo's fragments, delay tau and merge alpha included).
"""

from __future__ import annotations

import io

import torch
from torch import nn

import gradsync as gs
from gradsync.engine.local.exchange import local_sgd_outer_optimizer
from gradsync.engine.transport import comm
from gradsync.engine.transport.algorithms import HostTopology
from tests.helpers import dataset, mlp, mse, same_tensors, uneven_schedule

LR = 0.05
TOL = 1e-12


def flat_schedule(steps, world):
    """schedule[step][rank] = one index list; uneven, and sometimes empty."""
    return [[[i for micro in rank for i in micro] for rank in step]
            for step in uneven_schedule(steps, world)]


def inner_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def outer_optimizer(kind):
    if kind == "local":
        return local_sgd_outer_optimizer
    if kind == "nesterov":
        return None  # DiLoCo's default: SGD lr 0.7, momentum 0.9, Nesterov
    return lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.8)


def outer_factory(kind):
    from gradsync.engine.local.exchange import default_outer_optimizer
    return outer_optimizer(kind) or default_outer_optimizer


def inner_step(model, opt, x, y, idx):
    if idx:
        mse(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()


def local_steps(models, inners, x, y, shares, items):
    """Every worker's inner step on its share of the step; its items counted in every
    fragment's tally (``items[f][r]``)."""
    for r, idx in enumerate(shares):
        inner_step(models[r], inners[r], x, y, idx)
        for tally in items:
            tally[r] += len(idx)


def build_diloco(cfg, model, topology=None):
    """The inner optimizer and the DiLoCo (Streaming with ``F`` in ``cfg``) of a set-up;
    with ``topology``, a worker per host of it."""
    inner = inner_optimizer(cfg.get("inner", "sgd"), model.parameters())
    outer = outer_optimizer(cfg.get("outer", "nesterov"))
    if cfg.get("outer") == "instance":  # built over the model's parameters, as torchft does
        outer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.8)
    schedule = ("warmup_steps", "outer_momentum_warmup", "sync_every_max", "eager")
    common = dict(outer_optimizer=outer, sync_every=cfg["H"], compress=cfg.get("compress"),
                  topology=topology, **{k: cfg[k] for k in schedule if k in cfg})
    if "F" in cfg:
        d = gs.StreamingDiLoCo(model, inner, fragments=cfg["F"], delay=cfg["tau"],
                               alpha=cfg["alpha"], **common)
    else:
        d = gs.DiLoCo(model, inner, **common)
    return inner, d


# ---------------------------------------------------------------- the worker
def run_diloco(cfg, sched, steps, cut=None, model_fn=mlp):
    """This rank's side; with ``cut``, a checkpoint through bytes and a fresh object there."""
    rank = gs.rank()
    x, y = dataset()
    model = model_fn()
    inner, d = build_diloco(cfg, model)
    for s in range(steps):
        if s == cut:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "diloco": d.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf)
            model = model_fn(seed=9)  # different values: everything must come from the file
            inner, d = build_diloco(cfg, model)
            model.load_state_dict(saved["model"])
            d.load_state_dict(saved["diloco"])
        idx = sched[s][rank]
        inner_step(model, inner, x, y, idx)
        d.step(num_items=len(idx))
    d.sync_now()
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": d.stats()}


def host_worker_run(cfg, sched, per_host=2, after_step=None):
    """One rank of a run with a DiLoCo worker per host of ``per_host`` ranks (exact data
    parallelism inside it); ``after_step(rank, step)``, if given, runs after every step
    (what a training loop does between steps). Returns the parameters, the stats and the
    pseudo-gradient bytes and algorithms a comm observer saw."""
    rank = gs.rank()
    top = HostTopology(ranks_per_host=per_host)
    x, y = dataset()
    model = mlp()
    replica = gs.DataParallel(model, group=top.intra_group)
    inner, d = build_diloco(cfg, model, topology=top)
    inter = {"bytes": 0}

    def observe(phase, ev):  # pseudo-gradient reductions and the algorithm that ran them
        if phase == "launch" and ev.tag == "diloco":
            inter["bytes"] += ev.nbytes
            inter.setdefault("algorithms", set()).add((ev.meta or {}).get("algorithm"))

    with comm.add_observer(observe):
        for s in range(len(sched)):
            idx = sched[s][rank]
            if idx:
                replica.backward(mse(replica(x[idx]), y[idx]), num_items=len(idx))
            else:
                replica.backward(None, num_items=0)
            inner.step()
            inner.zero_grad()
            d.step(num_items=len(idx))
            if after_step is not None:
                after_step(rank, s)
        d.sync_now()
    if hasattr(d, "close"):
        d.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": d.stats(),
            "inter_host": inter}


def identical(res, world):
    """Rank 0's parameters, after checking that all ``world`` ranks hold bitwise the same."""
    assert len(res) == world
    p0 = res[0]["params"]
    for r, other in enumerate(res[1:], start=1):
        assert same_tensors(p0, other["params"]), f"rank {r} differs"
    return p0



# ---------------------------------------------------------------- single-process references
def reference_sync_sgd(sched):
    x, y = dataset()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in sched:
        idx = [i for rank in step for i in rank]
        inner_step(model, opt, x, y, idx)
    return [p.detach().clone() for p in model.parameters()]


def reference_local(sched, steps, world, cfg, fragments=None, make_outer=None):
    """K workers in one process: the algorithm as the papers write it (F=1: DiLoCo)."""
    x, y = dataset()
    H, tau, alpha = cfg["H"], cfg.get("tau", 0), cfg.get("alpha", 0.0)
    models = [mlp() for _ in range(world)]
    inners = [inner_optimizer(cfg.get("inner", "sgd"), m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    frags = fragments or [list(range(len(params[0])))]
    F = len(frags)
    anchors = [nn.Parameter(p.detach().clone()) for p in params[0]]
    make_outer = make_outer or outer_factory(cfg.get("outer", "nesterov"))
    outers = [make_outer([anchors[j] for j in f]) for f in frags]
    items = [[0.0] * world for _ in frags]
    offsets = [f * H // F for f in range(F)]
    last_sent = [0] * F
    inflight = []

    def apply(f, delta, total, a):
        with torch.no_grad():
            if total > 0:
                for j, g in zip(frags[f], delta):
                    anchors[j].grad = g
                outers[f].step()
                for j in frags[f]:
                    anchors[j].grad = None
            for r in range(world):
                for j in frags[f]:
                    params[r][j].copy_(a * params[r][j] + (1 - a) * anchors[j] if a else anchors[j])

    def send(f, s):
        total = sum(items[f])
        delta = [sum(items[f][r] * (anchors[j] - params[r][j]).detach() for r in range(world))
                 / (total or 1) for j in frags[f]]
        items[f] = [0.0] * world
        last_sent[f] = s
        return s + tau, f, delta, total

    for s in range(1, steps + 1):
        local_steps(models, inners, x, y, sched[s - 1], items)
        for job in [j for j in inflight if j[0] <= s]:
            inflight.remove(job)
            apply(job[1], job[2], job[3], alpha)
        for f in range(F):
            if (s - offsets[f]) % H == 0:
                job = send(f, s)
                if tau == 0:
                    apply(*job[1:], alpha)
                else:
                    inflight.append(job)
    for job in inflight:
        apply(*job[1:], alpha)
    if "F" in cfg or steps % H:
        for f in range(F):
            if last_sent[f] != steps:
                apply(*send(f, steps)[1:], 0.0)
            else:
                apply(f, [], 0, 0.0)
    return [p.detach().clone() for p in params[0]]


# ---------------------------------------------------------------- set-ups
STEPS = 14
SCHED = {w: flat_schedule(STEPS, w) for w in (2, 3)}
EVEN = {w: [[[((s * w + r) * 4 + i) % 96 for i in range(4)] for r in range(w)]
             for s in range(STEPS)] for w in (2, 3)}
DP = {"H": 1, "outer": "local"}
LOCAL = {"H": 4, "outer": "local"}
NESTEROV = {"H": 4, "outer": "nesterov"}
STREAM = {"H": 4, "outer": "momentum", "F": 2, "tau": 1, "alpha": 0.5}
STREAM_AS_DILOCO = {"H": 4, "outer": "nesterov", "F": 1, "tau": 0, "alpha": 0.0}
RESUME = {"H": 4, "outer": "nesterov", "inner": "adamw"}
RESUME_INT8 = {**RESUME, "compress": "int8"}
RESUME_STREAM = {**STREAM, "inner": "adamw", "compress": "bf16"}
INSTANCE = {"H": 4, "outer": "instance"}
