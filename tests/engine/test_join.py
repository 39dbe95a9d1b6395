"""Uneven inputs under ``model.join()``: ranks leave their loops at different iterations.

Three ranks hold 3, 8 and 6 micro-batches of different sizes and accumulate two
micro-batches per step under ``no_sync``, so rank 0 runs out in the middle of an
accumulation window and ranks 0 and 2 shadow the others' steps. Checked in float64:

* with ``backward(loss, num_items=n)`` and ``join(optimizer=opt)``, every strategy
  (DataParallel, ZeRO-1, ZeRO-2, stage 3) ends on every rank with exactly the model
  one process trains when each step is the union of the micro-batches the ranks
  still hold (1e-12, SGD with momentum), replicas bitwise identical;
* with plain ``loss.backward()`` and ``join()`` (DDP's form: a rank that left does
  not step; the last rank to leave is broadcast at the end), a BatchNorm model ends
  as torch DDP's ``join()`` leaves it, for both ``divide_by_initial_world_size``,
  after every step on the active ranks and at the end on every rank;
* ``throw_on_early_termination`` raises on every rank and leaves the group usable;
  ``enable=False`` costs no collective; what join() cannot shadow is refused;
* torch's generic ``Join([model])`` / ``Join([model, zero_optimizer])`` /
  ``Join([model], optimizer=opt)`` does the same: the exact mean on DataParallel,
  ZeRO-2 and stage 3, torch DDP's parameters under ``Join([ddp])``, the throw.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin

import gradsync as gs
from gradsync.engine.transport import comm
from tests.helpers import D_IN, D_OUT, errors_of, job_results, job_table, mlp, mse, run_jobs

WORLD, ACCUM, TOL = 3, 2, 1e-12
MICRO = [3, 8, 6]  # micro-batches per rank: rank 0 runs out inside a window
DDP_MICRO = [4, 8, 6]  # against torch DDP: every rank runs out at a window's end (see below)


def micro_batch(rank: int, k: int):
    """Rank ``rank``'s ``k``-th micro-batch: 1 to 4 rows, different on every rank."""
    g = torch.Generator().manual_seed(1000 + 100 * rank + k)
    n = 1 + (rank + 2 * k) % 4
    return (torch.randn(n, D_IN, generator=g, dtype=torch.float64),
            torch.randn(n, D_OUT, generator=g, dtype=torch.float64))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference():
    """One process: step s is every micro-batch 2s and 2s+1 that any rank holds."""
    torch.set_num_threads(1)
    model = mlp()
    opt = sgd(model.parameters())
    for s in range(-(-max(MICRO) // ACCUM)):
        xs, ys = zip(*[micro_batch(r, k) for r in range(WORLD)
                       for k in range(s * ACCUM, (s + 1) * ACCUM) if k < MICRO[r]])
        mse(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _join_context(model, opt, how: str):
    """gradsync's ``model.join(optimizer=opt)`` or torch's generic context around the model."""
    if how == "torch":  # torch's Join; a ZeroOptimizer is a joinable of its own
        return TorchJoin([model, opt] if isinstance(opt, gs.ZeroOptimizer) else [model],
                         **({} if isinstance(opt, gs.ZeroOptimizer) else {"optimizer": opt}))
    return model.join(optimizer=opt)


def exact_job(kind: str, how: str = "gradsync"):
    """This rank's loop over its own micro-batches inside join(optimizer=...), or inside
    torch's ``Join([model, zero_optimizer])`` / ``Join([model], optimizer=opt)``."""
    rank = dist.get_rank()
    module = mlp()
    if kind == "fsdp":
        model = gs.FullyShardedDataParallel(module, wrap={nn.Linear})
        opt = sgd(model.parameters())
    else:
        model = gs.DataParallel(module, bucket_cap_mb=0.0005)
        opt = (sgd(module.parameters()) if kind == "ddp" else
               gs.ZeroOptimizer(model, torch.optim.SGD, stage=int(kind[-1]), lr=0.05,
                                momentum=0.9))
    with _join_context(model, opt, how):
        for k in range(MICRO[rank]):
            x, y = micro_batch(rank, k)
            last = (k + 1) % ACCUM == 0
            with contextlib.nullcontext() if last else model.no_sync():
                model.backward(mse(model(x), y), num_items=len(x))
            if last:
                opt.step()
                opt.zero_grad()
    state = model.full_state_dict() if kind == "fsdp" else module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.inp = nn.Linear(D_IN, 8, bias=False)  # a bias before BatchNorm gets 0 + rounding
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, D_OUT)
        self.double()

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x))))


def ddp_parity_job(divide: bool, how: str = "method"):
    """The same loop under torch DDP's join() and gradsync's (plain backward, no optimizer
    for the ranks that left), with a BatchNorm whose buffers move.

    Every rank's data ends at a window's end: a rank that runs out inside one keeps
    what it accumulated under no_sync in gradsync's next synchronised step (the exact
    test above), where torch DDP's join hook all-reduces zeros in its place.
    """
    rank = dist.get_rank()
    out = {}
    for kind in ("torch", "gs"):
        module = BNNet()
        model = (nn.parallel.DistributedDataParallel(module) if kind == "torch"
                 else gs.DataParallel(module, bucket_cap_mb=0.0005))
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
        steps = []
        context = (model.join(divide_by_initial_world_size=divide) if how == "method" else
                   TorchJoin([model], divide_by_initial_world_size=divide))
        with context:
            for k in range(DDP_MICRO[rank]):
                x, y = micro_batch(rank, k)
                last = (k + 1) % ACCUM == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    mse(model(torch.cat([x, x + 1])), torch.cat([y, y])).backward()
                if last:
                    opt.step()
                    opt.zero_grad()
                    steps.append({n: p.detach().clone() for n, p in module.named_parameters()})
        out[kind] = {"steps": steps,
                     "final": {n: t.detach().clone() for n, t in module.state_dict().items()}}
    return out


def throw_job(how: str = "gradsync"):
    """throw_on_early_termination: every rank raises at the first iteration some rank
    lacks; afterwards the group still works."""
    rank = dist.get_rank()
    model = gs.DataParallel(mlp())
    opt = sgd(model.parameters())
    seen, error = 0, None
    context = (model.join(throw_on_early_termination=True, optimizer=opt) if how == "gradsync"
               else TorchJoin([model], throw_on_early_termination=True, optimizer=opt))
    try:
        with context:
            for k in range(MICRO[rank]):
                x, y = micro_batch(rank, k)
                model.backward(mse(model(x), y), num_items=len(x))
                opt.step()
                opt.zero_grad()
                seen += 1
    except RuntimeError as e:
        error = str(e)
    check = torch.ones(1)
    dist.all_reduce(check)
    return {"iterations": seen, "error": error, "group_check": float(check)}


def cost_job():
    """Collectives per step: join(enable=False) adds none; join() adds one small all-reduce
    per forward (the signal), and nothing else while every rank has data."""
    model = gs.DataParallel(mlp(), bucket_cap_mb=0.0005)
    opt = sgd(model.parameters())
    for k in range(2):  # the bucket rebuild after the first synchronised backward
        x, y = micro_batch(0, k)
        model.backward(mse(model(x), y), num_items=len(x))
    opt.zero_grad()
    counts = {}
    for name, ctx in (("plain", contextlib.nullcontext), ("disabled",
                      lambda: model.join(enable=False, optimizer=opt)),
                      ("join", lambda: model.join(optimizer=opt))):
        events = []
        def seen(phase, e, events=events):
            if phase == "launch":
                events.append(e.tag)
        with comm.add_observer(seen), ctx():
            for k in range(3):
                x, y = micro_batch(0, k)
                model.backward(mse(model(x), y), num_items=len(x))
                opt.step()
                opt.zero_grad()
        counts[name] = events
    return counts


def _enter_and_leave(context):
    with context:
        pass


def refusal_job():
    """What join() cannot shadow, refused on every rank before anything runs."""
    model = gs.DataParallel(mlp())
    zero = gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1)
    model2 = gs.DataParallel(mlp())
    zero2 = gs.ZeroOptimizer(model2, torch.optim.SGD, stage=2, lr=0.1)
    errors = errors_of(
        zero_without_optimizer=lambda: model.join(),
        sync_batchnorm=lambda: gs.DataParallel(gs.convert_sync_batchnorm(BNNet())).join(),
        not_an_optimizer=lambda: gs.DataParallel(mlp()).join(optimizer=42))
    del zero
    errors |= errors_of(  # torch's Join: ZeRO without its optimizer; the optimizer first
        torch_zero_without_optimizer=lambda: _enter_and_leave(TorchJoin([model])),
        torch_optimizer_first=lambda: _enter_and_leave(TorchJoin([zero2, model2])))
    model(micro_batch(0, 0)[0]).sum().backward()  # refused, not left half-open
    return errors


JOBS = job_table(
    *[(f"exact/{k}", exact_job, (k,)) for k in ("ddp", "zero1", "zero2", "fsdp")],
    *[(f"exact/{k}/torch", exact_job, (k, "torch")) for k in ("ddp", "zero2", "fsdp")],
    ("ddp_join/divide", ddp_parity_job, (True,)), ("ddp_join/keep", ddp_parity_job, (False,)),
    ("ddp_join/divide/torch", ddp_parity_job, (True, "torch")),
    ("ddp_join/keep/torch", ddp_parity_job, (False, "torch")),
    ("throw", throw_job, ()), ("throw/torch", throw_job, ("torch",)),
    ("cost", cost_job, ()), ("refusal", refusal_job, ()))


@pytest.fixture(scope="module")
def results():
    return gs.spawn(run_jobs, WORLD, JOBS, timeout_s=60)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exact/ddp", "exact/zero1", "exact/zero2", "exact/fsdp",
                                  "exact/ddp/torch", "exact/zero2/torch", "exact/fsdp/torch"])
def test_join_gives_the_exact_mean_over_what_the_active_ranks_hold(results, name):
    want = reference()
    per_rank = job_results(results, name)
    for rank, got in enumerate(per_rank):
        assert list(got) == list(want), (name, rank)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=TOL,
                                       msg=f"{name}, rank {rank}, {key}")
            assert torch.equal(got[key], per_rank[0][key]), (name, rank, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_join/divide", "ddp_join/keep", "ddp_join/divide/torch",
                                  "ddp_join/keep/torch"])
def test_join_without_optimizer_matches_torch_ddp_join(results, name):
    per_rank = job_results(results, name)
    for rank, got in enumerate(per_rank):
        t_steps, t_final = got["torch"]["steps"], got["torch"]["final"]
        g_steps, g_final = got["gs"]["steps"], got["gs"]["final"]
        assert len(t_steps) == len(g_steps) == DDP_MICRO[rank] // ACCUM
        assert list(g_final) == list(t_final) and t_final
        for s, (t, g) in enumerate(zip(t_steps, g_steps)):
            assert list(g) == list(t) and t
            for name in t:
                torch.testing.assert_close(g[name], t[name], rtol=0, atol=TOL,
                                           msg=f"rank {rank}, step {s}, {name}")
        for name in t_final:
            torch.testing.assert_close(g_final[name], t_final[name], rtol=0, atol=TOL,
                                       msg=f"rank {rank}, final {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["throw", "throw/torch"], ids=["model.join", "torch's Join"])
def test_throw_on_early_termination_raises_on_every_rank(results, name):
    got = job_results(results, name)
    shortest = min(MICRO)
    for rank, res in enumerate(got):
        assert res["iterations"] == shortest, (rank, res)
        assert res["error"] is not None and "exhausted" in res["error"], (rank, res)
        assert res["group_check"] == WORLD


@pytest.mark.slow
def test_join_costs_one_small_all_reduce_per_forward_and_nothing_when_disabled(results):
    counts = job_results(results, "cost")[0]
    assert list(counts) == ["plain", "disabled", "join"] and counts["plain"]
    assert counts["disabled"] == counts["plain"]
    assert [t for t in counts["join"] if t != "join"] == counts["plain"]
    assert counts["join"].count("join") == 3 + 1  # one per forward, one to agree all left


@pytest.mark.slow
def test_join_refuses_what_it_cannot_shadow(results):
    for errors in job_results(results, "refusal"):
        assert all(isinstance(m, str) for m in errors.values()) and len(errors) == 5, errors
        assert "needs optimizer=" in errors["zero_without_optimizer"]
        assert "SyncBatchNorm" in errors["sync_batchnorm"]
        assert "num_items=0" in errors["sync_batchnorm"]
        assert "takes an optimizer" in errors["not_an_optimizer"]
        assert "needs optimizer=" in errors["torch_zero_without_optimizer"]
        assert "Join([model, zero_optimizer])" in errors["torch_zero_without_optimizer"]
        assert "list the gradsync model before" in errors["torch_optimizer_first"]
