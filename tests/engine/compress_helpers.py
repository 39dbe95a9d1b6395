"""Inputs and compressors shared by the compressor tests (``test_compress*.py``)."""

from __future__ import annotations

import math

import torch

from gradsync.engine.compress import HalfPrecisionCompressor, Int8Compressor, PowerSGDCompressor

SHAPES = [(40, 30), (30,), (7, 3), (301,)]  # 1,852 elements: int8 slices of 256 do not divide
N = sum(math.prod(s) for s in SHAPES)
PAD = 5  # elements after the tensors, which no compressor may touch


def local_input(seed: int, rank: int, dtype=torch.float32, scale: float = 1.0):
    """This rank's contribution: N elements of the tensors, then PAD."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(N + PAD, generator=g, dtype=torch.float64) * scale).to(dtype)


def make_compressor(spec: str, **kw):
    if spec == "bf16":
        return HalfPrecisionCompressor("bf16", **kw)
    if spec == "fp16":
        return HalfPrecisionCompressor("fp16", **kw)
    if spec == "int8":
        return Int8Compressor(**kw)
    if spec.startswith("powersgd"):
        return PowerSGDCompressor(rank=int(spec.split(":")[1]), **kw)
    raise ValueError(spec)
