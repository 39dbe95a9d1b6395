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
    """Encode ``L`` elements into ``nbytes(L)`` bytes; decode them back.

    ``decode_into`` and ``add_into`` write into float tensors the caller owns, so a
    reduction makes no temporary copies of the bucket: measured on this project's
    machine, a version that returned fresh tensors spent 60% of a bf16 all-reduce
    of the MLP's 32 MB in conversions and allocations.
    """

    name = "?"
    align = 1  # slices handed to encode() are multiples of this (except the last)
    bits = 32  # bits per element on the wire, scales excluded

    def nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, seg: torch.Tensor) -> None:
        """Write ``x`` into the uint8 tensor ``seg`` (``nbytes(len(x))`` bytes)."""
        raise NotImplementedError

    def decode_into(self, seg: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (float, ``L`` elements) = the decoded segment."""
        raise NotImplementedError

    def add_into(self, seg: torch.Tensor, acc: torch.Tensor) -> None:
        """``acc += `` the decoded segment, rounded once in ``acc``'s dtype per element."""
        tmp = torch.empty_like(acc)
        self.decode_into(seg, tmp)
        acc += tmp


class Bf16Codec(Codec):
    name, bits = "bf16", 16

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x, seg):
        seg.view(torch.bfloat16).copy_(x)  # one rounding, to nearest even, from x's precision

    def decode_into(self, seg, out):
        out.copy_(seg.view(torch.bfloat16))

    def add_into(self, seg, acc):
        acc.add_(seg.view(torch.bfloat16))  # promoted exactly, then one rounding in acc's dtype


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
        if not x.numel():
            return 1.0
        low, high = torch.aminmax(x)  # 16x faster than vector_norm(ord=inf) on CPU here
        top = max(-float(low), float(high))
        if top == 0.0 or not math.isfinite(top):
            return 1.0
        _, exponent = math.frexp(top)  # top = m * 2**exponent, 0.5 <= m < 1
        shift = max(-_MAX_SHIFT, min(_MAX_SHIFT, _FP16_TOP - exponent))
        return math.ldexp(1.0, shift)

    def encode(self, x, seg):
        if not x.numel():
            return
        scale = self.scale_for(x)
        seg[:4].view(torch.float32).fill_(scale)
        seg[4:].view(torch.float16).copy_(x * scale)  # times a power of two: exact; one rounding

    def _scale(self, seg) -> float:
        return float(seg[:4].view(torch.float32)[0])

    def decode_into(self, seg, out):
        if out.numel():
            out.copy_(seg[4:].view(torch.float16)).mul_(1.0 / self._scale(seg))

    def add_into(self, seg, acc):
        if acc.numel():  # 1/scale is a power of two: the product is exact, one rounding in the add
            acc.add_(seg[4:].view(torch.float16), alpha=1.0 / self._scale(seg))


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
        """Scales, values, and padding to a multiple of 4 bytes: segments lie back to back in
        one wire buffer, and the next one's float32 scales must stay 4-byte aligned (with a
        block size that is a multiple of 4, only a final short slice is ever padded)."""
        return -(-(4 * self.blocks(numel) + numel) // 4) * 4 if numel else 0

    def _parts(self, numel: int):
        """(full blocks, elements in them): the last block may be shorter."""
        full = numel // self.block
        return full, full * self.block

    def encode(self, x, seg):
        n = x.numel()
        if not n:
            return
        nb = self.blocks(n)
        full, cut = self._parts(n)
        scale = torch.empty(nb, dtype=x.dtype, device=x.device)
        if full:  # abs().amax(): 4x faster than vector_norm(ord=inf) on CPU here
            torch.amax(x[:cut].view(full, self.block).abs(), dim=1, out=scale[:full])
        if cut < n:
            scale[full] = x[cut:].abs().max()
        scale32 = (scale / 127).to(torch.float32)
        seg[: 4 * nb].view(torch.float32).copy_(scale32)
        inv = scale32.to(x.dtype)
        inv = torch.where(inv > 0, inv, torch.ones_like(inv))
        q = seg[4 * nb:4 * nb + n].view(torch.int8)
        if full:
            rows = x[:cut].view(full, self.block) / inv[:full, None]
            q[:cut].view(full, self.block).copy_(rows.round_().clamp_(-127, 127))
        if cut < n:
            q[cut:].copy_((x[cut:] / inv[full]).round_().clamp_(-127, 127))

    def decode_into(self, seg, out):
        n = out.numel()
        if not n:
            return
        nb = self.blocks(n)
        full, cut = self._parts(n)
        scale = seg[: 4 * nb].view(torch.float32).to(out.dtype)
        q = seg[4 * nb:4 * nb + n].view(torch.int8)
        out.copy_(q)  # then scale in place: 2x faster than a mixed int8 x float multiply
        if full:
            out[:cut].view(full, self.block).mul_(scale[:full, None])
        if cut < n:
            out[cut:].mul_(scale[full])


CODECS = {"bf16": Bf16Codec, "fp16": Fp16Codec, "int8": Int8Codec}
