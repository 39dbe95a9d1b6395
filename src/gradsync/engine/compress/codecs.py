"""Wire formats for low-precision reduction: how a slice of floats becomes bytes and back.

A codec turns ``L`` elements into one self-contained segment of bytes (scales
first, then data, so every segment is a single point-to-point message) and
decodes a segment into a float tensor. Encoding is deterministic (round to
nearest even, no stochastic rounding): the same input gives the same bytes on
every rank, and decoding the same bytes gives bitwise the same floats, which is
what makes a compressed all-reduce leave identical values on every replica.

* ``bf16``: 2 bytes per element, no scale (bfloat16 has float32's exponent range).
* ``fp16``: 2 bytes per element plus one power-of-two scale per segment. The
  inputs are *sums* of per-item gradients, which can leave float16's range
  (65504) where a mean would not; torch's ``fp16_compress_hook`` avoids that by
  dividing by the world size first. A power-of-two scale that puts the segment's
  largest magnitude just under 2**15 is exact to apply and to undo, so the only
  error left is float16's 11-bit rounding (and underflow 2**-39 below the
  segment's largest value).
* ``int8``: 1 byte per element plus one float32 scale per block of ``block``
  elements (max |x| / 127), as in blockwise 8-bit quantization (Dettmers et al.,
  arXiv 2110.02861, section 2). The error per element is at most half its
  block's scale.
"""

from __future__ import annotations

import math

import torch


class Codec:
    """Encode ``L`` elements into ``nbytes(L)`` bytes; decode them back."""

    name = "?"
    align = 1  # slices handed to encode() are multiples of this (except the last)
    bits = 32  # bits per element on the wire, scales excluded

    def nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """Write ``x`` into the uint8 tensor ``seg``; return the decoded values (x's dtype)."""
        raise NotImplementedError

    def decode(self, seg: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class Bf16Codec(Codec):
    name, bits = "bf16", 16

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x, seg):
        half = seg.view(torch.bfloat16)
        half.copy_(x)  # one rounding, to nearest even, from x's own precision
        return half.to(x.dtype)

    def decode(self, seg, numel, dtype):
        return seg.view(torch.bfloat16).to(dtype)


_FP16_TOP = 15  # the segment's largest magnitude is scaled into [2**14, 2**15)
_MAX_SHIFT = 126  # keeps the scale and its inverse normal float32 numbers


class Fp16Codec(Codec):
    """float16 with a power-of-two scale per segment (4 bytes: float32 scale, then data)."""

    name, bits, align = "fp16", 16, 2  # align: keeps every segment 4-byte aligned

    def nbytes(self, numel: int) -> int:
        return 4 + 2 * numel if numel else 0

    @staticmethod
    def scale_for(x: torch.Tensor) -> float:
        """2**k with k chosen so max|x| * 2**k < 2**15 (1.0 for zero or non-finite input)."""
        top = float(x.abs().max()) if x.numel() else 0.0
        if top == 0.0 or not math.isfinite(top):
            return 1.0
        _, exponent = math.frexp(top)  # top = m * 2**exponent, 0.5 <= m < 1
        shift = max(-_MAX_SHIFT, min(_MAX_SHIFT, _FP16_TOP - exponent))
        return math.ldexp(1.0, shift)

    def encode(self, x, seg):
        if not x.numel():
            return x.clone()
        scale = self.scale_for(x)
        seg[:4].view(torch.float32).fill_(scale)
        half = seg[4:].view(torch.float16)
        half.copy_(x * scale)  # times a power of two: exact, then one rounding
        return half.to(x.dtype) * (1.0 / scale)

    def decode(self, seg, numel, dtype):
        if not numel:
            return torch.empty(0, dtype=dtype, device=seg.device)
        scale = float(seg[:4].view(torch.float32)[0])
        return seg[4:].view(torch.float16).to(dtype) * (1.0 / scale)


class Int8Codec(Codec):
    """Blockwise absmax int8: float32 scales of every block, then the int8 values."""

    name, bits = "int8", 8

    def __init__(self, block: int = 256):
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"int8 block size must be a positive int, got {block!r}")
        self.block = block
        self.align = block

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def nbytes(self, numel: int) -> int:
        return 4 * self.blocks(numel) + numel

    def encode(self, x, seg):
        n, nb = x.numel(), self.blocks(x.numel())
        if not n:
            return x.clone()
        padded = torch.zeros(nb * self.block, dtype=x.dtype, device=x.device)
        padded[:n] = x
        rows = padded.view(nb, self.block)
        scale = (rows.abs().amax(dim=1) / 127).to(torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
        q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        seg[: 4 * nb].view(torch.float32).copy_(scale)
        seg[4 * nb:].view(torch.int8).copy_(q.view(-1)[:n])
        return (q.to(x.dtype) * scale.to(x.dtype)[:, None]).view(-1)[:n]

    def decode(self, seg, numel, dtype):
        nb = self.blocks(numel)
        scale = seg[: 4 * nb].view(torch.float32).to(dtype)
        q = torch.zeros(nb * self.block, dtype=dtype, device=seg.device)
        q[:numel] = seg[4 * nb:].view(torch.int8)
        return (q.view(nb, self.block) * scale[:, None]).view(-1)[:numel]


CODECS = {"bf16": Bf16Codec, "fp16": Fp16Codec, "int8": Int8Codec}
