"""Gradient compressors: what each one promises, checked on real process groups.

Claims: every compressor leaves bitwise the same values on every rank (K = 2 and 3,
slices that do not divide, a rank that owns nothing); bf16/fp16 give exactly the
float32 sum, in rank order, of the rounded inputs, rounded once; int8's error is
within half a block scale per quantization; with error feedback the accumulated
compressed sum stays within about one step's error of the accumulated exact sum,
without it the gap grows; PowerSGD is exact for a sum of rank <= r and matches
torch's powerSGD_hook (times the world size: gradsync sends sums) on the same
inputs; state_dict round trips continue bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.engine.compress import (
    HalfPrecisionCompressor,
    Int8Compressor,
    PowerSGDCompressor,
    gradient_distance,
    parse_compression,
)
from gradsync.engine.compress.codecs import Bf16Codec, Fp16Codec, Int8Codec
from gradsync.engine.compress.powersgd import plan_matrices
from gradsync.engine.compress.quantized import slice_bounds
from gradsync.engine.transport import comm
from tests.helpers import job_results, run_jobs

SHAPES = [(40, 30), (30,), (7, 3), (301,)]  # 1,852 elements: int8 slices of 256 do not divide
N = sum(math.prod(s) for s in SHAPES)
PAD = 5


def _local(seed: int, rank: int, dtype=torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(N + PAD, generator=g, dtype=torch.float64) * scale).to(dtype)


def _make(spec: str, **kw):
    if spec == "bf16":
        return HalfPrecisionCompressor("bf16", **kw)
    if spec == "fp16":
        return HalfPrecisionCompressor("fp16", **kw)
    if spec == "int8":
        return Int8Compressor(**kw)
    if spec.startswith("powersgd"):
        return PowerSGDCompressor(rank=int(spec.split(":")[1]), **kw)
    raise ValueError(spec)


# ---------------------------------------------------------------- worker jobs
def _one_call(spec, dtype, scale=1.0, **kw):
    """This rank's input and the result of one compressed all-reduce."""
    x = _local(1, dist.get_rank(), dtype, scale)
    y = x.clone()
    c = _make(spec, **kw)
    c.all_reduce_(0, y, [torch.Size(s) for s in SHAPES])
    return x, y, c.stats()


def _tiny(spec):
    """Fewer elements than ranks x block: some ranks own no slice at all."""
    y = torch.full((5,), float(dist.get_rank() + 1))
    _make(spec).all_reduce_(3, y, [torch.Size([5])])
    return y


def _drift(spec, ef, steps=40):
    """||sum_t exact_t - sum_t compressed_t|| and the largest one-step error."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shapes = [torch.Size([32, 24]), torch.Size([24])]
    n = 32 * 24 + 24
    const = [torch.randn(n, generator=torch.Generator().manual_seed(50 + r)) for r in range(world)]
    kw = {"use_error_feedback": ef} if spec.startswith("powersgd") else {"error_feedback": ef}
    c = _make(spec, **kw)
    gap = torch.zeros(n, dtype=torch.float64)
    worst = 0.0
    norms = []
    for t in range(steps):
        gs_ = [const[r] + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(t * 7 + r))
               for r in range(world)]
        exact = sum(g.double() for g in gs_)
        y = gs_[rank].clone()
        c.all_reduce_(0, y, shapes)
        gap += exact - y.double()
        worst = max(worst, float((exact - y.double()).norm()))
        norms.append(float(gap.norm()))
    return norms, worst


def _low_rank_exact(r):
    """Each rank holds a rank-1 matrix; their sum has rank 2 <= r: PowerSGD is exact."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gens = [torch.Generator().manual_seed(70 + k) for k in range(world)]
    parts = [torch.outer(torch.randn(24, generator=g, dtype=torch.float64),
                         torch.randn(20, generator=g, dtype=torch.float64)) for g in gens]
    bias = [torch.randn(24, generator=g, dtype=torch.float64) for g in gens]
    flats = [torch.cat([p.reshape(-1), b]) for p, b in zip(parts, bias)]
    y = flats[rank].clone()
    c = PowerSGDCompressor(rank=r)
    shapes = [torch.Size([24, 20]), torch.Size([24])]
    c.all_reduce_(0, y, shapes)
    exact = sum(flats)
    again = flats[rank].clone()
    c.all_reduce_(0, again, shapes)  # warm start and zero residuals: exact again
    return float((y - exact).abs().max() / exact.abs().max()), \
        float((again - exact).abs().max() / exact.abs().max())


def _versus_torch_hook(r, steps=6):
    """torch DDP + powerSGD_hook and PowerSGDCompressor on the same bucket inputs."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 12)).double()
    ddp = DDP(model)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                               start_powerSGD_iter=2)
    seen = []

    def hook(st, bucket):
        inp = bucket.buffer().clone()
        shapes = [g.shape for g in bucket.gradients()]

        def keep(fut):
            value = fut.value()
            out = value[0] if isinstance(value, list) else value
            seen.append((inp, shapes, out.clone()))
            return out
        return psgd.powerSGD_hook(st, bucket).then(keep)

    ddp.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, 20, generator=g, dtype=torch.float64)
        y = torch.randn(8, 12, generator=g, dtype=torch.float64)
        ((ddp(x) - y) ** 2).mean().backward()
        ddp.zero_grad()
    ours = PowerSGDCompressor(rank=r, start_iter=2)
    gaps = []
    for inp, shapes, out in seen:
        mine = inp.clone()
        ours.all_reduce_(0, mine, shapes)
        gaps.append(float((mine - world * out).abs().max() / (world * out).abs().max()))
    return len(seen), gaps


def _resume(spec, steps=6, cut=3):
    """``steps`` calls; again with a save/load into a new compressor at ``cut``: same bits?"""
    rank = dist.get_rank()
    shapes = [torch.Size(s) for s in SHAPES]
    inputs = [_local(10 + t, rank) for t in range(steps)]
    a = _make(spec)
    ref = []
    for x in inputs:
        y = x.clone()
        a.all_reduce_(0, y, shapes)
        ref.append(y)
    b = _make(spec)
    out = []
    for t, x in enumerate(inputs):
        if t == cut:
            state = b.state_dict()
            b = _make(spec)
            b.load_state_dict(state)
        y = x.clone()
        b.all_reduce_(0, y, shapes)
        out.append(y)
    return all(torch.equal(p, q) for p, q in zip(ref, out))


def _data_parallel(spec, steps=4):
    """DataParallel with CompressedBuckets: per step, every parameter's .grad and the tags seen."""
    from tests.helpers import dataset, mlp, mse

    rank = dist.get_rank()
    x, y = dataset()
    tags: list[str] = []
    dp = gs.DataParallel(mlp(), bucket_cap_mb=0.0005, first_bucket_mb=0.0001,
                         reduction=gs.CompressedBuckets(parse_compression(spec)))
    out = []
    with comm.add_observer(lambda phase, ev: tags.append(ev.tag) if phase == "launch" else None):
        for s in range(steps):
            tags.clear()
            idx = [(7 * s + 3 * rank + i) % 96 for i in range(3 + 4 * rank)]
            dp.backward(mse(dp(x[idx]), y[idx]), num_items=len(idx))
            out.append(([p.grad.clone() for p in dp.module.parameters()], sorted(set(tags)),
                        len(dp.buckets)))
            dp.zero_grad()
    return out


def _int8_block(block):
    """int8 with a block size that is not a multiple of 4: segments stay aligned."""
    return _one_call("int8", torch.float32, 1.0, block=block)


def _nonfinite(spec, steps=3):
    """Rank 0's first contribution holds a NaN and an inf; the later ones are finite.
    Per call: (result, exact float64 sum)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shapes = [torch.Size([32, 24]), torch.Size([24])]
    n = 32 * 24 + 24
    kw = {"error_feedback": True} if spec == "bf16" else {}
    c = _make(spec, **kw)
    out = []
    for t in range(steps):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(90 + 5 * t + r))
              for r in range(world)]
        if t == 0:
            xs[0][3], xs[0][500] = math.nan, math.inf
        y = xs[rank].clone()
        c.all_reduce_(0, y, shapes)
        out.append((y, sum(x.double() for x in xs)))
    return out


SPECS = ["bf16", "fp16", "int8", "powersgd:1", "powersgd:2"]


def _jobs(world):
    jobs = [(_one_call, (s, torch.float32)) for s in SPECS]
    jobs += [(_one_call, (s, torch.float64)) for s in ("bf16", "int8", "powersgd:2")]
    jobs += [(_tiny, (s,)) for s in ("bf16", "fp16", "int8")]
    if world == 2:
        jobs += [(_one_call, ("fp16", torch.float32, scale)) for scale in (1e7, 1e-6)]
        jobs += [(_drift, (s, ef, 60 if s.startswith("powersgd") else 40))
                 for s in ("bf16", "int8", "powersgd:1") for ef in (True, False)]
        jobs += [(_low_rank_exact, (2,)), (_versus_torch_hook, (1,)), (_versus_torch_hook, (2,))]
        jobs += [(_resume, (s,)) for s in ("int8", "powersgd:1")]
        jobs += [(_data_parallel, (s,)) for s in ("int8", "powersgd:1")]
        jobs += [(_nonfinite, (s,)) for s in ("bf16", "int8", "powersgd:1")]
    jobs += [(_int8_block, (b,)) for b in (7, 1, 130)]
    return jobs


def _index(world, fn, args):
    return _jobs(world).index((fn, args))


_cache: dict = {}


def _results(world, index):
    if world not in _cache:
        _cache[world] = gs.spawn(run_jobs, world, _jobs(world), timeout_s=60)
    return job_results(_cache[world], index)


# ---------------------------------------------------------------- multi-process claims
def _ratio(res):
    """Over all ranks: slices of uneven length make one rank's own ratio differ."""
    return sum(st.exact_bytes for *_, st in res) / sum(st.sent_bytes for *_, st in res)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_bitwise_the_same_result(world):
    for i, _ in enumerate(_jobs(world)[:8]):
        res = _results(world, i)
        y0 = res[0][1]
        for r, (x, y, _) in enumerate(res):
            assert torch.equal(y[:N], y0[:N]), f"job {i}: rank {r} differs"
            assert torch.equal(y[N:], x[N:]), f"job {i}: padding touched on rank {r}"
    for i in range(8, 11):  # 5 elements: only rank 0 owns a slice
        res = _results(world, i)
        assert all(torch.equal(y, res[0]) for y in res)
        assert torch.allclose(res[0], torch.full((5,), world * (world + 1) / 2), rtol=1e-2)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [(0, "bf16", torch.float32), (1, "fp16", torch.float32),
                                  (5, "bf16", torch.float64)])
def test_half_precision_is_the_float32_sum_of_rounded_inputs_rounded_once(world, case):
    index, fmt, dtype = case
    res = _results(world, index)
    half = torch.bfloat16 if fmt == "bf16" else torch.float16
    acc = torch.promote_types(dtype, torch.float32)
    total = res[0][0][:N].to(half).to(acc)
    for x, _, _ in res[1:]:
        total = total + x[:N].to(half).to(acc)
    expect = total.to(half).to(dtype)
    assert torch.equal(res[0][1][:N], expect)
    assert _ratio(res) == pytest.approx(2 * res[0][0].element_size() / 4, rel=0.02)


def test_fp16_scales_sums_out_of_float16_range():
    for index, scale in ((11, 1e7), (12, 1e-6)):
        res = _results(2, index)
        exact = sum(x[:N].double() for x, _, _ in res)
        y = res[0][1][:N]
        assert torch.isfinite(y).all()
        cos, rel = gradient_distance(y, exact)
        assert rel < 1e-3, f"scale {scale}: relative error {rel}"


BLOCK = 256


def _block_amax(v):
    nb = -(-N // BLOCK)
    padded = torch.zeros(nb * BLOCK, dtype=torch.float64)
    padded[:N] = v.abs()
    return padded.view(nb, BLOCK).amax(dim=1).repeat_interleave(BLOCK)[:N]


@pytest.mark.parametrize("world", [2, 3])
def test_int8_error_within_half_a_block_scale_per_quantization(world):
    """Each rank's quantization errs by at most amax/254 per element, the owner's too."""
    for index, dtype in ((2, torch.float32), (6, torch.float64)):
        res = _results(world, index)
        xs = [x[:N].double() for x, _, _ in res]
        exact = sum(xs)
        bound = sum(_block_amax(v) for v in xs) / 254 + _block_amax(exact) * 1.01 / 254
        err = (res[0][1][:N].double() - exact).abs()
        worst = float((err - bound).max())
        assert bool((err <= bound * (1 + 1e-6) + 1e-30).all()), f"{dtype}: {worst}"
        assert _ratio(res) == pytest.approx(4 * res[0][0].element_size() / 4 / (1 + 4 / BLOCK),
                                            rel=0.05)


def test_error_feedback_keeps_the_accumulated_gap_bounded():
    """bf16 and int8: with error feedback the gap between the accumulated exact and
    compressed sums stays within about one step's error (it is the current residual);
    without, it grows like a random walk. PowerSGD rank 1 on full-rank gradients: the
    residual plateaus (at about 13 steps' error here: a rank-1 sketch of a rank-24
    matrix needs that much backlog to pass on what comes in), without it grows linearly."""
    base = 13
    for k, spec in enumerate(("bf16", "int8")):
        with_ef, worst = _results(2, base + 2 * k)[0]
        without, _ = _results(2, base + 2 * k + 1)[0]
        assert max(with_ef) <= 2 * worst, f"{spec}: {max(with_ef):.3g} vs one step {worst:.3g}"
        assert without[-1] >= 5 * with_ef[-1], f"{spec}: {without[-1]:.3g} vs {with_ef[-1]:.3g}"
        assert without[-1] > 1.5 * without[len(without) // 4], f"{spec}: no growth without EF"
    with_ef, _ = _results(2, base + 4)[0]
    without, _ = _results(2, base + 5)[0]
    assert with_ef[59] <= 1.3 * with_ef[29], f"powersgd: {with_ef[29]:.3g} -> {with_ef[59]:.3g}"
    assert without[59] >= 1.8 * without[29], f"powersgd: {without[29]:.3g} -> {without[59]:.3g}"
    assert with_ef[59] <= 0.3 * without[59]


def test_powersgd_exact_when_the_sum_has_rank_at_most_r():
    first, again = _results(2, 19)[0]
    assert first < 1e-12 and again < 1e-12, (first, again)


@pytest.mark.parametrize("index,r", [(20, 1), (21, 2)])
def test_powersgd_matches_torch_hook_times_world_size(index, r):
    calls, gaps = _results(2, index)[0]
    assert calls == 6
    assert max(gaps) < 1e-9, gaps


@pytest.mark.parametrize("index", [22, 23])
def test_state_dict_round_trip_continues_bit_for_bit(index):
    assert all(_results(2, index))


@pytest.mark.parametrize("index,spec", [(24, "int8"), (25, "powersgd:1")])
def test_data_parallel_with_compressed_buckets(index, spec):
    """Window 1 exact (before the bucket rebuild), then compressed on the thread; the
    gradient is the compressed sum over the exact global item count."""
    from tests.helpers import dataset, mlp, mse

    res = _results(2, index)
    x, y = dataset()
    for s in range(4):
        grads = [res[r][s][0] for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*grads)), f"step {s}: ranks differ"
        idx = [(7 * s + 3 * r + i) % 96 for r in range(2) for i in range(3 + 4 * r)]
        model = mlp()
        mse(model(x[idx]), y[idx]).backward()
        exact = [p.grad for p in model.parameters()]
        cos, rel = gradient_distance(grads[0], exact)
        tags = res[0][s][1]
        assert res[0][s][2] > 1
        if s == 0:
            assert rel < 1e-12 and not any(t.startswith("compress") for t in tags), (rel, tags)
        else:
            assert f"compress-{spec.split(':')[0]}" in tags, tags
            assert 1e-12 < rel < (2e-2 if spec == "int8" else 1.0), rel
            assert cos > (0.999 if spec == "int8" else 0.5), cos


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("block", [7, 1, 130])
def test_int8_any_block_size_is_bitwise_identical_and_within_its_bound(world, block):
    """Segments of every slice lie back to back in one buffer; blocks that are not a
    multiple of 4 bytes once made the next segment's float32 scales unaligned (a crash)."""
    res = _results(world, _index(world, _int8_block, (block,)))
    xs = [x[:N].double() for x, _, _ in res]
    exact = sum(xs)
    for r, (x, y, _) in enumerate(res):
        assert torch.equal(y[:N], res[0][1][:N]), f"rank {r} differs"
        assert torch.equal(y[N:], x[N:]), f"padding touched on rank {r}"
    nb = -(-N // block)

    def amax(v):
        padded = torch.zeros(nb * block, dtype=torch.float64)
        padded[:N] = v.abs()
        return padded.view(nb, block).amax(dim=1).repeat_interleave(block)[:N]

    bound = sum(amax(v) for v in xs) / 254 + amax(exact) * 1.01 / 254
    assert bool(((res[0][1][:N].double() - exact).abs() <= bound * (1 + 1e-6) + 1e-30).all())


@pytest.mark.parametrize("spec", ["bf16", "int8", "powersgd:1"])
def test_a_nonfinite_step_does_not_poison_the_next_ones(spec):
    """Error feedback carries a step's loss into the next: a NaN gradient once made every
    later reduction NaN (with --on-nonfinite skip-step, every later step skipped). The bad
    step stays non-finite; the next ones are finite, within their usual error, the same on
    every rank."""
    res = _results(2, _index(2, _nonfinite, (spec,)))
    for t in range(3):
        torch.testing.assert_close(res[0][t][0], res[1][t][0], rtol=0, atol=0, equal_nan=True)
    assert not torch.isfinite(res[0][0][0]).all()
    for t in (1, 2):
        y, exact = res[0][t]
        assert torch.isfinite(y).all(), f"{spec}: call {t} still non-finite"
        cos, rel = gradient_distance(y, exact)
        assert cos > (0.99 if spec != "powersgd:1" else 0.1), (t, cos, rel)


# ---------------------------------------------------------------- single process
def test_parse_compression():
    assert parse_compression("none") is None and parse_compression(None) is None
    assert parse_compression("bf16").name == "bf16"
    assert parse_compression("FP16").name == "fp16"
    assert parse_compression("powersgd:4").rank == 4
    assert parse_compression("powersgd").rank == 1
    assert parse_compression("int8").block == 256
    assert parse_compression("int8:64").block == 64
    for bad in ("zip", "powersgd:0", "powersgd:x", "bf16:2", ""):
        with pytest.raises(gs.UsageError, match="compression"):
            parse_compression(bad)


def _encode(codec, x):
    seg = torch.empty(codec.nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, seg)
    out = torch.empty_like(x)
    codec.decode_into(seg, out)
    return seg, out


def test_codecs_round_trip_and_bounds():
    x = torch.randn(1000, dtype=torch.float64) * torch.logspace(-3, 3, 1000, dtype=torch.float64)
    codec = Int8Codec(128)
    seg, dec = _encode(codec, x)
    scale = seg[:4 * 8].view(torch.float32).double().repeat_interleave(128)[:1000]
    assert bool(((dec - x).abs() <= scale / 2 * (1 + 1e-6)).all())
    acc = torch.ones(1000, dtype=torch.float64)
    codec.add_into(seg, acc)
    assert torch.equal(acc, 1 + dec)
    assert torch.equal(_encode(codec, torch.zeros(300))[1], torch.zeros(300))
    nan = torch.ones(300)
    nan[7] = math.nan
    assert torch.isnan(_encode(codec, nan)[1][:128]).all()  # its block, not the others
    assert torch.isfinite(_encode(codec, nan)[1][128:]).all()
    fp16 = Fp16Codec()
    big = torch.tensor([1e9, -3e8, 1.0, 0.0])
    seg, dec = _encode(fp16, big)
    assert torch.isfinite(dec).all() and torch.allclose(dec, big, rtol=1e-3)
    acc = torch.full((4,), 0.5)
    fp16.add_into(seg, acc)
    assert torch.equal(acc, 0.5 + dec)
    small = torch.tensor([1e-30, 3e-31])
    assert torch.allclose(_encode(fp16, small)[1], small, rtol=1e-3)
    bf16 = Bf16Codec()
    assert torch.equal(_encode(bf16, x)[1], x.to(torch.bfloat16).double())
    assert slice_bounds(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]
    assert slice_bounds(5, 3, 256) == [(0, 5), (5, 5), (5, 5)]


def test_powersgd_skips_what_would_not_compress_2x():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    shapes = [(64, 64), (4, 4), (64,), (8, 3, 3, 3), (100, 3), (), (5, 0)]
    mats, exact = plan_matrices([torch.Size(s) for s in shapes], 2, 2)
    compressed = {o for o, *_ in mats}
    offset = 0
    for s in shapes:
        numel = math.prod(s)
        if len(s) >= 2 and numel:
            n, m = s[0], numel // s[0]
            assert (offset in compressed) == _should_compress(n, m, min(n, m, 2), 2)[0], s
        else:
            assert offset not in compressed
        offset += numel


def test_gradient_distance_and_bad_input():
    e = torch.tensor([3.0, 4.0])
    assert gradient_distance(e, e) == (1.0, 0.0)
    cos, rel = gradient_distance([torch.tensor([3.0]), torch.tensor([0.0])], e)
    assert cos == pytest.approx(0.6) and rel == pytest.approx(0.8)
    assert gradient_distance(torch.zeros(2), torch.zeros(2)) == (1.0, 0.0)
    with pytest.raises(gs.UsageError, match="only 4"):
        Int8Compressor().all_reduce_(7, torch.zeros(4), [torch.Size([5])])
    for key in ("bucket", -1, True, 1.5):
        with pytest.raises(gs.UsageError, match="key must be an int"):
            Int8Compressor().all_reduce_(key, torch.zeros(4), [torch.Size([4])])
    with pytest.raises(gs.UsageError, match="floating point"):
        Int8Compressor().all_reduce_(7, torch.zeros(4, dtype=torch.int64), [torch.Size([4])])
    with pytest.raises(gs.UsageError, match="cannot load"):
        Int8Compressor().load_state_dict(PowerSGDCompressor().state_dict())
