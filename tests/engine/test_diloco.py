"""DiLoCo, Local SGD and Streaming DiLoCo against single-process simulations, in float64.

Claims: with H = 1, inner SGD and an outer SGD of lr 1, DiLoCo is synchronous
data-parallel SGD on the global batch (<= 1e-12, uneven items, a worker with none);
Local SGD (outer lr 1, no momentum) is parameter averaging, and DiLoCo's default
Nesterov outer step is the item-weighted outer step of a K-worker simulation;
Streaming DiLoCo (F fragments, delay tau, merge alpha) matches a simulation of the
paper's schedule, equals DiLoCo bit for bit when F = 1, tau = 0, alpha = 0, and
sends 1/F of DiLoCo's bytes at its busiest step (counted by a comm observer);
state_dict round trips mid-interval (and with reductions in flight) continue bit
for bit; buffers are item-weighted averages; replicas end bitwise identical.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.engine.local.diloco import local_sgd_outer_optimizer
from gradsync.engine.local.fragments import split_parameters
from gradsync.engine.transport import comm
from tests.helpers import (
    dataset,
    errors_of,
    job_results,
    max_gap,
    mlp,
    mse,
    run_jobs,
    uneven_schedule,
)

LR = 0.05
TOL = 1e-12


def _flat_schedule(steps, world):
    """schedule[step][rank] = one index list; uneven, and sometimes empty."""
    return [[[i for micro in rank for i in micro] for rank in step]
            for step in uneven_schedule(steps, world)]


def _inner(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _outer(kind):
    if kind == "local":
        return local_sgd_outer_optimizer
    if kind == "nesterov":
        return None  # DiLoCo's default: SGD lr 0.7, momentum 0.9, Nesterov
    return lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.8)


def _outer_factory(kind):
    from gradsync.engine.local.diloco import default_outer_optimizer
    return _outer(kind) or default_outer_optimizer


def _inner_step(model, opt, x, y, idx):
    if idx:
        mse(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()


def _build(cfg, model):
    inner = _inner(cfg.get("inner", "sgd"), model.parameters())
    outer = _outer(cfg.get("outer", "nesterov"))
    if cfg.get("outer") == "instance":  # built over the model's parameters, as torchft does
        outer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.8)
    common = dict(outer_optimizer=outer, sync_every=cfg["H"],
                  compress=cfg.get("compress"))
    if "F" in cfg:
        d = gs.StreamingDiLoCo(model, inner, fragments=cfg["F"], delay=cfg["tau"],
                               alpha=cfg["alpha"], **common)
    else:
        d = gs.DiLoCo(model, inner, **common)
    return inner, d


# ---------------------------------------------------------------- workers
def _run(cfg, sched, steps, cut=None, model_fn=mlp):
    """This rank's side; with ``cut``, a checkpoint through bytes and a fresh object there."""
    rank = gs.rank()
    x, y = dataset()
    model = model_fn()
    inner, d = _build(cfg, model)
    for s in range(steps):
        if s == cut:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "diloco": d.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf)
            model = model_fn(seed=9)  # different values: everything must come from the file
            inner, d = _build(cfg, model)
            model.load_state_dict(saved["model"])
            d.load_state_dict(saved["diloco"])
        idx = sched[s][rank]
        _inner_step(model, inner, x, y, idx)
        d.step(num_items=len(idx))
    d.sync_now()
    return [p.detach().clone() for p in model.parameters()], d.stats()


def _bytes_per_step(cfg, steps):
    """Pseudo-gradient bytes by the step they were sent at, seen by a comm observer."""
    per_step: dict[int, int] = {}

    def observe(phase, ev):
        if phase == "launch" and ev.tag == "diloco":
            per_step[ev.meta["step"]] = per_step.get(ev.meta["step"], 0) + ev.nbytes

    model = _equal_blocks()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(gs.rank()))
    inner, d = _build(cfg, model)
    with comm.add_observer(observe):
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
            d.step(num_items=4)
    return per_step


def _equal_blocks(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)]).double()


def _bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()


def _buffers_averaged():
    """Running statistics after a sync are the item-weighted average of the replicas'."""
    rank = gs.rank()
    x, y = dataset()
    model = _bn_model()
    inner, d = _build({"H": 2, "outer": "local"}, model)
    sizes = [3 + 2 * rank, 4 + 3 * rank]
    before = None
    for s, n in enumerate(sizes):
        idx = list(range(10 * rank + s, 10 * rank + s + n))
        _inner_step(model, inner, x, y, idx)
        if s == 1:
            before = [b.clone() for b in model.buffers()]
        d.step(num_items=n)
    return sum(sizes), before, [b.clone() for b in model.buffers()]


def _bad_input():
    """Every rank raises the same one-line error; no rank hangs."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return errors_of(lambda: gs.DiLoCo(model, opt, sync_every=0),
                     lambda: gs.DiLoCo(model, "sgd"),
                     lambda: gs.DiLoCo(model, opt, compress="zip"),
                     lambda: gs.StreamingDiLoCo(model, opt, sync_every=4, delay=4),
                     lambda: gs.StreamingDiLoCo(model, opt, alpha=1.0),
                     lambda: gs.StreamingDiLoCo(model, opt, fragments=99),
                     lambda: gs.DiLoCo(mlp(hidden=12 + gs.rank()), opt),
                     lambda: gs.DiLoCo(model, opt).step(num_items=-1),
                     lambda: gs.DiLoCo(model, opt, sync_every=3).load_state_dict(
                         gs.DiLoCo(model, opt, sync_every=4).state_dict()),
                     lambda: gs.DiLoCo(model, opt,
                                       torch.optim.SGD(list(model.parameters())[:1])))


# ---------------------------------------------------------------- single-process references
def _reference_sync_sgd(sched):
    x, y = dataset()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in sched:
        idx = [i for rank in step for i in rank]
        _inner_step(model, opt, x, y, idx)
    return [p.detach().clone() for p in model.parameters()]


def _reference_local(sched, steps, world, cfg, fragments=None):
    """K workers in one process: the algorithm as the papers write it (F=1: DiLoCo)."""
    x, y = dataset()
    H, tau, alpha = cfg["H"], cfg.get("tau", 0), cfg.get("alpha", 0.0)
    models = [mlp() for _ in range(world)]
    inners = [_inner(cfg.get("inner", "sgd"), m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    frags = fragments or [list(range(len(params[0])))]
    F = len(frags)
    anchors = [nn.Parameter(p.detach().clone()) for p in params[0]]
    outers = [_outer_factory(cfg.get("outer", "nesterov"))([anchors[j] for j in f]) for f in frags]
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
        for r in range(world):
            idx = sched[s - 1][r]
            _inner_step(models[r], inners[r], x, y, idx)
            for f in range(F):
                items[f][r] += len(idx)
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


# ---------------------------------------------------------------- the jobs
STEPS = 14
SCHED = {w: _flat_schedule(STEPS, w) for w in (2, 3)}
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


def _jobs(world):
    sched = SCHED[world]
    jobs = [(_run, (DP, sched, STEPS)), (_run, (LOCAL, EVEN[world], STEPS)),
            (_run, (NESTEROV, sched, STEPS)), (_run, (STREAM, sched, STEPS))]
    if world == 2:
        jobs += [(_run, (STREAM_AS_DILOCO, sched, STEPS)),
                 (_run, (RESUME, sched, STEPS)), (_run, (RESUME, sched, STEPS, 6)),
                 (_run, (RESUME_INT8, sched, STEPS)), (_run, (RESUME_INT8, sched, STEPS, 6)),
                 (_run, (RESUME_STREAM, sched, STEPS)), (_run, (RESUME_STREAM, sched, STEPS, 6)),
                 (_bytes_per_step, ({"H": 8, "outer": "local"}, 16)),
                 (_bytes_per_step, ({"H": 8, "outer": "local", "F": 4, "tau": 0, "alpha": 0.0},
                                    16)),
                 (_buffers_averaged, ()), (_bad_input, ()), (_run, (INSTANCE, sched, STEPS))]
    return jobs


_cache: dict = {}


def _results(world, index):
    if world not in _cache:
        _cache[world] = gs.spawn(run_jobs, world, _jobs(world), timeout_s=60)
    return job_results(_cache[world], index)


def _identical(res):
    p0 = res[0][0]
    for r, (p, _) in enumerate(res[1:], start=1):
        assert all(torch.equal(a, b) for a, b in zip(p0, p)), f"rank {r} differs"
    return p0


# ---------------------------------------------------------------- claims
@pytest.mark.parametrize("world", [2, 3])
def test_h1_is_synchronous_data_parallel_sgd_with_uneven_items(world):
    params = _identical(_results(world, 0))
    assert any(not rank for step in SCHED[world] for rank in step)  # a worker with nothing
    gap = max_gap(params, _reference_sync_sgd(SCHED[world]))
    assert gap <= TOL, f"gap {gap:.3e}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("index,cfg,even", [(1, LOCAL, True), (2, NESTEROV, False)])
def test_outer_step_matches_a_k_worker_simulation(world, index, cfg, even):
    """index 1: Local SGD = plain averaging (equal items); 2: Nesterov, item-weighted."""
    sched = (EVEN if even else SCHED)[world]
    params = _identical(_results(world, index))
    gap = max_gap(params, _reference_local(sched, STEPS, world, cfg))
    assert gap <= TOL, f"gap {gap:.3e}"


@pytest.mark.parametrize("world", [2, 3])
def test_streaming_matches_the_papers_schedule(world):
    params = _identical(_results(world, 3))
    frags = [[0, 1], [2, 3, 4, 5]]  # mlp(): 6 tensors, 84 + 156 + 39 elements, cut at half
    model = mlp()
    assert [[n for n, _ in f] for f in split_parameters(model, 2)] == \
        [[list(dict(model.named_parameters()))[j] for j in f] for f in frags]
    gap = max_gap(params, _reference_local(SCHED[world], STEPS, world, STREAM, frags))
    assert gap <= TOL, f"gap {gap:.3e}"


def test_streaming_with_one_fragment_no_delay_no_mixing_is_diloco():
    streaming, _ = _results(2, 4)[0]
    diloco, _ = _results(2, 2)[0]
    assert all(torch.equal(a, b) for a, b in zip(streaming, diloco))


@pytest.mark.parametrize("plain,cut", [(5, 6), (7, 8), (9, 10)])
def test_resume_mid_interval_continues_bit_for_bit(plain, cut):
    """AdamW inner state, Nesterov outer state, int8 residuals, a streaming reduction in flight."""
    for r in range(2):
        a, sa = _results(2, plain)[r]
        b, sb = _results(2, cut)[r]
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"rank {r}"
        assert sa == sb


def test_compressed_pseudo_gradients_stay_close_and_report_their_ratio():
    exact, st_exact = _results(2, 5)[0]
    int8, st_int8 = _results(2, 7)[0]
    _identical(_results(2, 7))
    cos, rel = gs.gradient_distance(int8, exact)
    assert rel < 1e-2, rel
    assert st_exact.ratio == pytest.approx(1.0)
    assert st_int8.ratio > 5, st_int8  # float64 pseudo-gradients: 8 bytes -> 1 (+ scales)
    assert st_int8.syncs == st_exact.syncs == 4  # steps 4, 8, 12 and sync_now at 14


def test_streaming_peak_bytes_per_step_drop_by_fragments():
    diloco, streaming = _results(2, 11)[0], _results(2, 12)[0]
    assert sorted(diloco) == [8, 16]
    assert sorted(streaming) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert max(diloco.values()) == 4 * max(streaming.values())
    assert sum(diloco.values()) == sum(streaming.values())


def test_buffers_are_item_weighted_averages():
    res = _results(2, 13)
    total = sum(n for n, _, _ in res)
    for k, after in enumerate(res[0][2]):
        if after.is_floating_point():
            expect = sum(n * before[k] for n, before, _ in res) / total
            torch.testing.assert_close(after, expect, rtol=1e-12, atol=1e-14)
        else:
            assert torch.equal(after, res[0][1][k])
        assert all(torch.equal(after, r[2][k]) for r in res)


def test_bad_input_is_a_one_line_error_on_every_rank():
    res = _results(2, 14)
    assert res[0][:6] == res[1][:6]
    expected = ["sync_every", "inner_optimizer", "unknown compression", "delay", "alpha",
                "fragments", "differs across ranks", "num_items", "sync_every=4",
                "must hold every trainable parameter"]
    for msg, word in zip(res[0], expected):
        assert msg is not None and word in msg and "\n" not in msg, (word, msg)


def test_outer_optimizer_built_over_the_model_is_rebuilt_over_the_global_copy():
    """torchft's convention: ``outer = SGD(model.parameters(), ...)``; the same run as the
    factory ``lambda ps: SGD(ps, ...)`` with those options."""
    sched = SCHED[2]
    params = _identical(_results(2, 15))
    gap = max_gap(params, _reference_local(sched, STEPS, 2, {"H": 4, "outer": "momentum"}))
    assert gap <= TOL, f"gap {gap:.3e}"
