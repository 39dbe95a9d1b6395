"""Layer 3, compress: gradient compression for slow links (bf16, fp16, PowerSGD, int8).

Every compressor offers one call, ``all_reduce_(key, flat, shapes, group)``
(see ``base.py`` for the contract), and reports what it sent (``stats()``).
``parse_compression`` maps the command line's ``--compress`` value to one;
``CompressedBuckets`` plugs one into DataParallel
(``gs.DataParallel(module, reduction=CompressedBuckets(compressor))``), and
``HostCompressedBuckets`` composes one with the two-level all-reduce (exact inside
a host, compressed across hosts: ``hierarchical.py``); ``delay=1`` applies each
step's sum one step late, its communication overlapped with the next step
(``delayed.py``).
None of them is exact; ``none`` (no compressor) stays the default and the only
mode ``gradsync verify`` calls exact. Measured ratios, errors and how to choose:
docs/slow_links.md. Imports ``buckets`` and ``transport``.
"""

from __future__ import annotations

from ...errors import UsageError
from .base import CompressionStats, Compressor, gradient_distance
from .hierarchical import HostCompressedBuckets
from .powersgd import PowerSGDCompressor
from .quantized import HalfPrecisionCompressor, Int8Compressor, QuantizedCompressor
from .reduction import CompressedBuckets

COMPRESSION_CHOICES = ("none", "bf16", "fp16", "powersgd:R", "int8")
COMPRESSION_HELP = ("gradient compression: none (exact), bf16 or fp16 (16 bits on every hop, "
                    "sums in float32), powersgd:R (rank-R PowerSGD, error feedback), int8 "
                    "(blockwise int8 with error feedback; int8:B for blocks of B elements)")


def parse_compression(spec: str | None) -> Compressor | None:
    """``"none"`` -> None; ``"bf16"``, ``"fp16"``, ``"powersgd:R"``, ``"int8"`` -> a new compressor.

    ``"powersgd"`` alone means rank 1; ``"int8:B"`` sets the block size (default 256).
    A new instance each call: one per model, since it holds per-bucket state.
    """
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise UsageError(f"compression must be a string like 'bf16', got {type(spec).__name__}")
    text = spec.strip().lower()
    name, _, arg = text.partition(":")
    if name == "none" and not arg:
        return None
    if name in ("bf16", "fp16") and not arg:
        return HalfPrecisionCompressor(name)
    if name in ("powersgd", "int8"):
        value = _positive_int(arg, spec) if arg else None
        if name == "powersgd":
            return PowerSGDCompressor(rank=value or 1)
        return Int8Compressor(block=value or 256)
    raise UsageError(f"unknown compression {spec!r}; choose one of "
                     f"{', '.join(COMPRESSION_CHOICES)}")


def _positive_int(arg: str, spec: str) -> int:
    try:
        value = int(arg)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"compression {spec!r}: {arg!r} is not a positive whole number")
    return value


__all__ = [
    "COMPRESSION_CHOICES",
    "COMPRESSION_HELP",
    "CompressedBuckets",
    "CompressionStats",
    "Compressor",
    "HalfPrecisionCompressor",
    "HostCompressedBuckets",
    "Int8Compressor",
    "PowerSGDCompressor",
    "QuantizedCompressor",
    "gradient_distance",
    "parse_compression",
]
