"""Compression composed with the two-level all-reduce (``engine/compress/hierarchical.py``).

Four gloo ranks emulate hosts with ``HostTopology(ranks_per_host=g)``, as
``test_hierarchical.py`` does. Claims, float64 where exactness is claimed:

* with an exact stand-in compressor (an all-reduce) the composed path is bitwise the
  exact two-level sum: the intra-host reduce-scatter, the chunks handed across hosts
  and the all-gather are wired right, directly and inside DataParallel;
* int8 across hosts keeps error feedback (the accumulated gap stays within one
  step's error; without it, it grows); PowerSGD gets whole matrices (it is exact on a
  rank-1 sum and sends less than an all-reduce would);
* one rank per host is the plain compressor over the world, bitwise; one host sends
  nothing compressed, so it is exact;
* bf16, int8, PowerSGD: replicas bitwise identical after every step, close to the
  one-process trajectory.
"""

from __future__ import annotations

import os

import pytest
import torch

import gradsync as gs
from gradsync.engine.compress import CompressedBuckets, Compressor, parse_compression
from gradsync.engine.compress.hierarchical import HostCompressedBuckets, all_reduce_, host_chunks
from gradsync.engine.strategy.options import SyncOptions, auto_collectives
from gradsync.engine.strategy.registry import build_strategy
from gradsync.engine.transport import comm
from gradsync.engine.transport.algorithms import HostTopology, hierarchical
from tests.engine.compress_helpers import SHAPES, N, local_input, make_compressor
from tests.helpers import SharedSpawn, dataset, job_table, max_gap, mlp, mse, same_tensors

WORLD, STEPS = 4, 3


class ExactSum(Compressor):
    """A "compressor" that all-reduces exactly: the composed path with nothing lost."""

    name = "exact"

    def __init__(self, whole_tensors: bool = False):
        super().__init__()
        self.whole_tensors = whole_tensors

    def _reduce(self, key, x, shapes, group, rank, world) -> int:
        comm.all_reduce(x, group, tag="exact-sum")
        return 0


def _algorithm_exact(whole):
    """Composed with ExactSum against hierarchical.all_reduce_ on the same inputs."""
    top = HostTopology(ranks_per_host=2)
    shapes = [torch.Size(s) for s in SHAPES]
    x = local_input(3, gs.rank(), torch.float64)
    pad = x[N:].clone()
    composed, ref = x.clone(), x[:N].clone()
    all_reduce_(ExactSum(whole), 0, composed, shapes, top)
    hierarchical.all_reduce_(ref, top)
    return {"same": torch.equal(composed[:N], ref), "pad_kept": torch.equal(composed[N:], pad)}


def _drift(ef, steps=30):
    """||sum_t exact_t - sum_t composed int8_t|| after each call, and the worst single call."""
    top, rank = HostTopology(ranks_per_host=2), gs.rank()
    n = 32 * 24 + 24
    shapes = [torch.Size([32, 24]), torch.Size([24])]
    const = [torch.randn(n, generator=torch.Generator().manual_seed(50 + r)) for r in range(WORLD)]
    c = make_compressor("int8", error_feedback=ef)
    gap, worst, norms = torch.zeros(n, dtype=torch.float64), 0.0, []
    for t in range(steps):
        xs = [const[r] + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(7 * t + r))
              for r in range(WORLD)]
        y = xs[rank].clone()
        all_reduce_(c, 0, y, shapes, top)
        err = sum(v.double() for v in xs) - y.double()
        gap += err
        worst = max(worst, float(err.norm()))
        norms.append(float(gap.norm()))
    return {"gap_norms": norms, "worst_call": worst}


def _powersgd_rank_one():
    """Every rank holds multiples of the same rank-1 matrices: PowerSGD rank 1 is exact."""
    top, rank = HostTopology(ranks_per_host=2), gs.rank()
    g = torch.Generator().manual_seed(5)
    parts = []
    for s in SHAPES:
        if len(s) == 2:
            u, v = (torch.randn(k, generator=g, dtype=torch.float64) for k in s)
            parts.append([(r + 1) * torch.outer(u, v).reshape(-1) for r in range(WORLD)])
        else:
            parts.append([torch.randn(s[0], generator=g, dtype=torch.float64)
                          for _ in range(WORLD)])
    flats = [torch.cat([p[r] for p in parts]) for r in range(WORLD)]
    c = make_compressor("powersgd:1")
    y = flats[rank].clone()
    all_reduce_(c, 0, y, [torch.Size(s) for s in SHAPES], top)
    exact = sum(flats)
    stats = c.stats()
    return {"error": float((y - exact).abs().max() / exact.abs().max()),
            "sent": stats.sent_bytes, "exact_bytes": stats.exact_bytes, "result": y}


def _train(make_reduction=None, collectives="native", topology=None):
    """STEPS SGD steps of the float64 MLP on uneven items; parameters after every step."""
    rank = gs.rank()
    x, y = dataset()
    reduction = make_reduction() if make_reduction else None
    dp = gs.DataParallel(mlp(), bucket_cap_mb=0.0005, first_bucket_mb=0.0002,
                         collectives=collectives, topology=topology, reduction=reduction)
    opt = torch.optim.SGD(dp.parameters(), lr=0.05)
    seen, out = set(), []
    watch = (lambda k, ev: seen.add((ev.meta.get("algorithm") or "native",
                                     ev.meta.get("codec", "")))
             if k == "launch" and ev.tag.startswith("bucket") else None)
    with comm.add_observer(watch):
        for s in range(STEPS):
            idx = [(11 * s + 5 * rank + i) % 96 for i in range(2 + 3 * rank)]
            dp.backward(mse(dp(x[idx]), y[idx]), num_items=len(idx))
            opt.step()
            opt.zero_grad()
            out.append([p.detach().clone() for p in dp.module.parameters()])
    if reduction is not None:
        reduction.close()
    return {"steps": out, "seen": sorted(seen)}


def _composed(spec, g=2, **kw):
    top = HostTopology(ranks_per_host=g)
    return _train(lambda: HostCompressedBuckets(parse_compression(spec), top, **kw),
                  "hierarchical", top)


def _exact_through_composed():
    top = HostTopology(ranks_per_host=2)
    return {"composed": _train(lambda: HostCompressedBuckets(ExactSum(), top), "hierarchical",
                               top),
            "hierarchical": _train(None, "hierarchical", top)}


def _one_rank_per_host_int8():
    """No exact first window on either side: it would sum with gloo's order on one side."""
    return {"composed": _composed("int8", g=1, exact_windows=0),
            "plain": _train(lambda: CompressedBuckets(parse_compression("int8"),
                                                      exact_windows=0))}


def _auto_on_one_host():
    """``--collectives auto`` in a one-host spawn: what the builders chose, and the env."""
    exact = build_strategy(mlp(), "ddp", "fp32", torch.optim.SGD, lr=0.1)
    int8 = build_strategy(mlp(), "ddp", "fp32", torch.optim.SGD, lr=0.1,
                          sync=SyncOptions(compress="int8"))
    int8.reduction.close()
    return {"auto": auto_collectives(), "exact": (exact.collectives, exact.model.collectives),
            "int8": (int8.collectives, type(int8.reduction).__name__),
            "env": [os.environ.get(k) for k in ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE")]}


def _reference():
    """The one-process trajectory of ``_train``'s schedule."""
    x, y = dataset()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for s in range(STEPS):
        idx = [(11 * s + 5 * r + i) % 96 for r in range(WORLD) for i in range(2 + 3 * r)]
        mse(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


COMPOSED = ("bf16", "int8", "powersgd:1")
JOBS = job_table(
    ("algorithm/exact/even", _algorithm_exact, (False,)),
    ("algorithm/exact/whole", _algorithm_exact, (True,)),
    ("drift/ef", _drift, (True,)), ("drift/no-ef", _drift, (False,)),
    ("powersgd/rank1", _powersgd_rank_one, ()),
    *[(f"dp/{s}", _composed, (s,)) for s in COMPOSED],
    ("dp/exact", _exact_through_composed, ()),
    ("dp/one-rank-per-host", _one_rank_per_host_int8, ()),
    ("dp/one-host", _composed, ("int8", WORLD)),
    ("auto/one-host", _auto_on_one_host, ()),
    ("reference", _reference, ()))
SPAWN = SharedSpawn(JOBS, timeout_s=60)


def _results(name):
    return SPAWN.results(name, WORLD)


def _ref():
    """The one-process trajectory, computed in the spawn (the first optimizer step of a
    process costs seconds of lazy imports, already paid there)."""
    return _results("reference")[0]


@pytest.mark.parametrize("bounds", ["even", "whole"])
def test_exact_stand_in_gives_the_two_level_sum_bitwise(bounds):
    for res in _results(f"algorithm/exact/{bounds}"):
        assert res == {"same": True, "pad_kept": True}


def test_int8_across_hosts_keeps_error_feedback():
    ef = _results("drift/ef")[0]
    without = _results("drift/no-ef")[0]["gap_norms"]
    gaps, worst = ef["gap_norms"], ef["worst_call"]
    assert max(gaps) <= 2 * worst, f"{max(gaps):.3g} vs one call {worst:.3g}"
    assert without[-1] >= 4 * gaps[-1], f"{without[-1]:.3g} vs {gaps[-1]:.3g}"


def test_powersgd_across_hosts_compresses_whole_matrices():
    results = _results("powersgd/rank1")
    for res in results:
        assert res["error"] < 1e-12, res["error"]
        assert torch.equal(res["result"], results[0]["result"])
    # local rank 0 carries the 40x30 matrix: rank-1 factors instead of 1,200 numbers
    assert results[0]["sent"] * 10 < results[0]["exact_bytes"], results[0]


def _assert_replicas_identical(run):
    for step in range(STEPS):
        for r in range(1, WORLD):
            assert same_tensors(run[r]["steps"][step], run[0]["steps"][step]), (r, step)


@pytest.mark.parametrize("spec", COMPOSED)
def test_composed_replicas_identical_and_close_to_one_process(spec):
    run = _results(f"dp/{spec}")
    _assert_replicas_identical(run)
    assert run[0]["seen"] == [("hierarchical", ""), ("hierarchical", spec.split(":")[0])]
    ref = _ref()
    assert max_gap(run[0]["steps"][0], ref[0]) <= 1e-12  # the first window is exact
    # measured 2.0e-5 (bf16), 3.3e-5 (int8), 6.3e-3 (powersgd:1); skipping the intra-host
    # sum gave 6.2e-3 for bf16 and int8
    gap = max_gap(run[0]["steps"][-1], ref[-1])
    assert 1e-9 < gap < {"bf16": 2e-4, "int8": 3e-4, "powersgd:1": 0.03}[spec], gap


def test_exact_stand_in_inside_dataparallel_is_hierarchical_exact_bitwise():
    for res in _results("dp/exact"):
        for a, b in zip(res["composed"]["steps"], res["hierarchical"]["steps"]):
            assert same_tensors(a, b)
    assert max_gap(res["composed"]["steps"][-1], _ref()[-1]) <= 1e-12


def test_one_rank_per_host_is_the_plain_compressor_bitwise():
    for res in _results("dp/one-rank-per-host"):
        assert len(res["composed"]["steps"]) == STEPS
        for a, b in zip(res["composed"]["steps"], res["plain"]["steps"]):
            assert same_tensors(a, b)
    assert max_gap(res["plain"]["steps"][-1], _ref()[-1]) > 1e-9  # int8 did compress


def test_one_host_sends_nothing_compressed_so_is_exact():
    run = _results("dp/one-host")
    _assert_replicas_identical(run)
    assert max_gap(run[0]["steps"][-1], _ref()[-1]) <= 1e-12


def test_chunks_for_whole_tensors_end_at_tensor_boundaries():
    shapes = [torch.Size(s) for s in SHAPES]  # 1,200 + 30 + 21 + 301 elements
    bounds, chunks = host_chunks(shapes, 2, whole_tensors=True)
    assert bounds == [0, 1200, N] and chunks == [shapes[:1], shapes[1:]]
    bounds, chunks = host_chunks(shapes, 4, whole_tensors=True)
    assert bounds == [0, 0, 1200, 1200, N]  # the big matrix leaves two local ranks nothing
    assert sum(chunks, []) == shapes
    bounds, chunks = host_chunks(shapes, 2, whole_tensors=False)
    assert bounds == [0, N // 2, N] and chunks == [[torch.Size([N // 2])]] * 2



def test_auto_on_one_host_is_native():
    for res in _results("auto/one-host"):
        assert res == {"auto": "native", "exact": ("native", "native"),
                       "int8": ("native", "CompressedBuckets"), "env": ["1", str(WORLD)]}
