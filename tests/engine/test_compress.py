"""Gradient compressors, one call at a time, on real process groups of K = 2 and 3.

Claims: every compressor leaves bitwise the same values on every rank (slices that do
not divide, a rank that owns nothing) and never touches what lies after the tensors;
bf16/fp16 give exactly the float32 sum, in rank order, of the rounded inputs, rounded
once; fp16 scales sums outside its range; int8's error is within half a block scale per
quantization, for any block size. Over many calls (error feedback, PowerSGD, state_dict,
DataParallel, non-finite steps): ``test_compress_steps.py``; single process:
``test_compress_codecs.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync.engine.compress import gradient_distance
from tests.engine.compress_helpers import SHAPES, N, local_input, make_compressor
from tests.helpers import SharedSpawn, job_table


def _one_call(spec, dtype, scale=1.0, **kw):
    """This rank's input and the result of one compressed all-reduce."""
    x = local_input(1, dist.get_rank(), dtype, scale)
    y = x.clone()
    c = make_compressor(spec, **kw)
    c.all_reduce_(0, y, [torch.Size(s) for s in SHAPES])
    return {"input": x, "output": y, "stats": c.stats()}


def _tiny(spec):
    """Fewer elements than ranks x block: some ranks own no slice at all."""
    y = torch.full((5,), float(dist.get_rank() + 1))
    make_compressor(spec).all_reduce_(3, y, [torch.Size([5])])
    return y


SPECS = ["bf16", "fp16", "int8", "powersgd:1", "powersgd:2"]
ONE_CALL = [(s, torch.float32) for s in SPECS] + [(s, torch.float64) for s in
                                                  ("bf16", "int8", "powersgd:2")]
TINY = ("bf16", "fp16", "int8")
FP16_SCALES = (1e7, 1e-6)
INT8_BLOCKS = (7, 1, 130)


def _name(spec, dtype):
    return f"{spec}/{str(dtype).removeprefix('torch.')}"


def _jobs(world):
    entries = [(_name(s, d), _one_call, (s, d)) for s, d in ONE_CALL]
    entries += [(f"tiny/{s}", _tiny, (s,)) for s in TINY]
    if world == 2:
        entries += [(f"fp16/scale{k}", _one_call, ("fp16", torch.float32, k))
                    for k in FP16_SCALES]
    entries += [(f"int8/block{b}", _int8_block, (b,)) for b in INT8_BLOCKS]
    return job_table(*entries)


def _int8_block(block):
    """int8 with a block size that is not a multiple of 4: segments stay aligned."""
    return _one_call("int8", torch.float32, 1.0, block=block)


SPAWN = SharedSpawn(_jobs, timeout_s=60)


def _results(world, name):
    return SPAWN.results(name, world)


def _ratio(res):
    """Over all ranks: slices of uneven length make one rank's own ratio differ."""
    return (sum(r["stats"].exact_bytes for r in res)
            / sum(r["stats"].sent_bytes for r in res))


def _assert_same_everywhere(res, what):
    y0 = res[0]["output"]
    for r, got in enumerate(res):
        assert torch.equal(got["output"][:N], y0[:N]), f"{what}: rank {r} differs"
        assert torch.equal(got["output"][N:], got["input"][N:]), f"{what}: padding, rank {r}"


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_bitwise_the_same_result(world):
    for spec, dtype in ONE_CALL:
        _assert_same_everywhere(_results(world, _name(spec, dtype)), _name(spec, dtype))
    for spec in TINY:  # 5 elements: only rank 0 owns a slice
        res = _results(world, f"tiny/{spec}")
        assert all(torch.equal(y, res[0]) for y in res)
        assert torch.allclose(res[0], torch.full((5,), world * (world + 1) / 2), rtol=1e-2)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.float32), ("fp16", torch.float32),
                                       ("bf16", torch.float64)])
def test_half_precision_is_the_float32_sum_of_rounded_inputs_rounded_once(world, fmt, dtype):
    res = _results(world, _name(fmt, dtype))
    half = torch.bfloat16 if fmt == "bf16" else torch.float16
    acc = torch.promote_types(dtype, torch.float32)
    assert res[0]["input"].dtype == dtype
    total = res[0]["input"][:N].to(half).to(acc)
    for r in res[1:]:
        total = total + r["input"][:N].to(half).to(acc)
    expect = total.to(half).to(dtype)
    assert torch.equal(res[0]["output"][:N], expect)
    assert _ratio(res) == pytest.approx(2 * res[0]["input"].element_size() / 4, rel=0.02)


@pytest.mark.parametrize("scale", FP16_SCALES)
def test_fp16_scales_sums_out_of_float16_range(scale):
    res = _results(2, f"fp16/scale{scale}")
    exact = sum(r["input"][:N].double() for r in res)
    largest = float(exact.abs().max())  # beyond float16's largest / smallest normal
    assert largest > 65504 if scale > 1 else largest < 2**-14, largest
    y = res[0]["output"][:N]
    assert torch.isfinite(y).all()
    cos, rel = gradient_distance(y, exact)
    assert rel < 1e-3, f"scale {scale}: relative error {rel}"


def _int8_bound(xs, block):
    """Per element: each rank's quantization errs by <= amax/254 of its block, the
    owner's re-quantization of the sum by as much of the sum's (1% slack on that amax)."""
    nb = -(-N // block)

    def amax(v):
        padded = torch.zeros(nb * block, dtype=torch.float64)
        padded[:N] = v.abs()
        return padded.view(nb, block).amax(dim=1).repeat_interleave(block)[:N]

    return sum(amax(v) for v in xs) / 254 + amax(sum(xs)) * 1.01 / 254


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_error_within_half_a_block_scale_per_quantization(world, dtype):
    """Each rank's quantization errs by at most amax/254 per element, the owner's too."""
    res = _results(world, _name("int8", dtype))
    xs = [r["input"][:N].double() for r in res]
    bound = _int8_bound(xs, 256)
    err = (res[0]["output"][:N].double() - sum(xs)).abs()
    worst = float((err - bound).max())
    assert bool((err <= bound * (1 + 1e-6) + 1e-30).all()), f"{dtype}: {worst}"
    assert _ratio(res) == pytest.approx(
        4 * res[0]["input"].element_size() / 4 / (1 + 4 / 256), rel=0.05)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("block", INT8_BLOCKS)
def test_int8_any_block_size_is_bitwise_identical_and_within_its_bound(world, block):
    """Segments of every slice lie back to back in one buffer; blocks that are not a
    multiple of 4 bytes once made the next segment's float32 scales unaligned (a crash)."""
    res = _results(world, f"int8/block{block}")
    _assert_same_everywhere(res, f"block {block}")
    xs = [r["input"][:N].double() for r in res]
    err = (res[0]["output"][:N].double() - sum(xs)).abs()
    assert bool((err <= _int8_bound(xs, block) * (1 + 1e-6) + 1e-30).all())
