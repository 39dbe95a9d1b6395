"""Gradient compressors in one process: the --compression parser, the codecs' round trips
and bounds, which matrices PowerSGD compresses (torch's rule), gradient_distance and the
errors for bad input. On process groups: ``test_compress.py``, ``test_compress_steps.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradsync as gs
from gradsync.engine.compress import (
    Int8Compressor,
    PowerSGDCompressor,
    gradient_distance,
    parse_compression,
)
from gradsync.engine.compress.codecs import Bf16Codec, Fp16Codec, Int8Codec
from gradsync.engine.compress.powersgd import plan_matrices
from gradsync.engine.compress.quantized import slice_bounds


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
