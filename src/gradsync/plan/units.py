"""Parsing of the quantities people type: parameter counts, byte sizes, rates, times.

Why one module: every planner command reads sizes, and an unknown unit must be
the same one-line error (:class:`gradsync.errors.UsageError`) everywhere.

Units convention of the planner: **GB means 10^9 bytes** and GB/s means 10^9
bytes per second (as vendors quote link bandwidth and as the ZeRO paper counts
memory). Binary units are accepted when written as such (GiB = 2^30). The
simulator's bucket sizes stay in DDP's MB, which is MiB (see
``gradsync.engine.buckets.plan.mb_to_bytes``).
"""

from __future__ import annotations

import math
import re

from ..errors import UsageError

GB = 1e9

_BYTE_UNITS = {
    "b": 1, "": 1,
    "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _split(text: str, what: str) -> tuple[float, str]:
    m = re.fullmatch(_NUM + r"\s*([A-Za-zµ/]*)", str(text).strip())
    if not m:
        raise UsageError(f"cannot read {what} {text!r}")
    return float(m.group(1)), m.group(2)


def _positive(value: float, text: str, what: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{what} must be > 0, got {text!r}")
    return value


def parse_count(text: str | float | int, what: str = "parameter count") -> int:
    """'7e9', '7B', '125M', '1.3b', '350k' -> an integer count (B = 10^9)."""
    if isinstance(text, (int, float)):
        return int(_positive(float(text), str(text), what))
    value, unit = _split(text, what)
    key = unit.lower()
    if key not in _COUNT_SUFFIX:
        raise UsageError(f"unknown suffix {unit!r} in {what} {text!r} (use K, M, B or T)")
    return int(round(_positive(value * _COUNT_SUFFIX[key], text, what)))


def parse_bytes(text: str | float | int, what: str = "size") -> float:
    """'80GB' -> 8e10, '24GiB' -> 24*2^30, '512MB' -> 5.12e8; a bare number is bytes."""
    if isinstance(text, (int, float)):
        return _positive(float(text), str(text), what)
    value, unit = _split(text, what)
    key = unit.lower()
    if key not in _BYTE_UNITS:
        raise UsageError(
            f"unknown unit {unit!r} in {what} {text!r} (use B, KB, MB, GB, TB or KiB, MiB, GiB)"
        )
    return _positive(value * _BYTE_UNITS[key], text, what)


_BIT_PREFIX = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | float | int, what: str = "bandwidth") -> float:
    """'25GB/s', '25GB' or '25' (GB/s for a bare number) -> bytes per second.

    Network links are often quoted in bits: '100Gbit/s' and '100Gbps' are read as
    bits (divided by 8); '100Gb/s' is refused as ambiguous rather than guessed,
    since reading it as bytes would be an 8x error.
    """
    if isinstance(text, (int, float)):
        return _positive(float(text), str(text), what) * GB
    s = str(text).strip()
    if s.lower().endswith("bps"):
        s = s[:-3] + "bit"
    elif s.lower().endswith("/s"):
        s = s[:-2]
    value, unit = _split(s, what)
    if unit == "":
        return _positive(value, text, what) * GB
    if unit.lower().endswith("bit") and unit[:-3].lower() in _BIT_PREFIX:
        return _positive(value * _BIT_PREFIX[unit[:-3].lower()] / 8, text, what)
    if len(unit) == 2 and unit[1] == "b" and unit[0].lower() in _BIT_PREFIX:
        raise UsageError(
            f"{what} {text!r} is ambiguous: write {unit[0].upper()}B/s for bytes "
            f"or {unit[0].upper()}bit/s for bits"
        )
    return parse_bytes(s, what)


def parse_time(text: str | float | int, what: str = "latency", allow_zero: bool = True) -> float:
    """'5us', '1ms', '0.002s', '0' -> seconds (a bare number is seconds)."""
    if isinstance(text, (int, float)):
        value, unit, s = float(text), "", str(text)
    else:
        value, unit = _split(text, what)
        s = str(text)
    if unit.lower() not in _TIME_UNITS:
        raise UsageError(f"unknown time unit {unit!r} in {what} {s!r} (use s, ms, us or ns)")
    seconds = value * _TIME_UNITS[unit.lower()]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise UsageError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {s!r}")
    return seconds


def parse_int_list(text: str, what: str = "worker counts") -> list[int]:
    """'8,64,512' -> [8, 64, 512]; every entry must be a positive integer."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            n = int(part)
        except ValueError:
            raise UsageError(f"{what}: {part!r} is not an integer") from None
        if n <= 0:
            raise UsageError(f"{what} must be >= 1, got {n}")
        out.append(n)
    if not out:
        raise UsageError(f"{what}: empty list")
    return out


def fmt_bytes(n: float) -> str:
    """Decimal (10^9) units, matching the planner's convention."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"
