"""Bytes on the wire over a run, and how they compare with the exact all-reduce.

The report's summary table, its exactness section and `gradsync train`'s closing
table all say the same line, built here, so the three cannot disagree.
Definitions (torch-free: the report reads them from the run's files):

* **sent**: the sum over steps of ``sent_bytes`` in metrics.jsonl -- what rank 0
  put on the wire, as the strategy counts it: gradient buckets (compressed or
  not) or, with ``--sync diloco``, pseudo-gradients, item counts and buffers at
  the syncs. Every rank of a bandwidth-optimal all-reduce sends the same.
* **exact**: what ``--sync exact`` without compression would have put on the wire
  from rank 0 over the same steps: per step, 2 (N-1)/N of each gradient bucket's
  bytes (``engine.compress.base.ring_bytes``, repeated here to stay torch-free),
  N being that step's worker count. The gradient sizes are the run's
  ``gradient_bytes`` (summary.json: one entry per bucket, or one for the whole
  gradient of a run without buckets), else plan.json's buckets (a run cut off).
* **ratio to exact** = sent / exact over the steps that recorded ``sent_bytes``
  (zero1/2/3 do not count theirs: they have no line). 1 means exact
  synchronisation's traffic; 0.25 means a quarter of it ("4x less").
"""

from __future__ import annotations

from dataclasses import dataclass


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``nbytes`` (as the engine)."""
    return 0 if world <= 1 else (2 * (world - 1) * int(nbytes)) // world


@dataclass(frozen=True)
class Traffic:
    sent: int
    exact: int | None  # None: gradient sizes unknown
    steps: int

    @property
    def ratio(self) -> float | None:
        return self.sent / self.exact if self.exact else None


def gradient_bytes(summary: dict | None, plan: dict | None) -> list[int] | None:
    """The gradient sizes an exact all-reduce would send, per bucket (see module docstring)."""
    sizes = (summary or {}).get("gradient_bytes")
    if isinstance(sizes, list) and sizes:
        return [int(b) for b in sizes]
    buckets = (plan or {}).get("buckets")
    if isinstance(buckets, list) and buckets:
        return [int(b["nbytes"]) for b in buckets]
    return None


def exact_step_bytes(sizes: list[int] | None, world: int) -> int | None:
    return None if sizes is None else sum(ring_bytes(b, world) for b in sizes)


def run_traffic(records: list[dict], sizes: list[int] | None) -> Traffic | None:
    """Totals over the steps whose record has ``sent_bytes``; None when none has."""
    counted = [r for r in records if isinstance(r.get("sent_bytes"), (int, float))]
    if not counted:
        return None
    exact = None
    if sizes is not None:
        exact = sum(exact_step_bytes(sizes, int(r.get("world_size") or 1)) for r in counted)
    return Traffic(int(sum(r["sent_bytes"] for r in counted)), exact, len(counted))


def size_text(n: int) -> str:
    """``7,440 B`` or ``1.23 MiB (1,289,748 B)``: readable, and exact for a check."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit} ({n:,} B)"
    return f"{n:,} B"


def traffic_line(t: Traffic | None, strategy: str = "") -> str:
    """The one line the summary table and the terminal print about bytes sent."""
    if t is None:
        who = f"{strategy} does" if strategy else "the strategy does"
        return f"not counted ({who} not record bytes on the wire)"
    head = f"{size_text(t.sent)} over {t.steps} step{'s' * (t.steps != 1)}"
    if t.exact is None:
        return head + "; ratio to exact unknown (no gradient sizes recorded)"
    if t.sent == t.exact:
        return head + "; ratio to exact 1 (this is the exact all-reduce's traffic)"
    r = t.ratio
    if r is None:  # an exact all-reduce would send nothing (one worker)
        return head + "; the exact all-reduce would send nothing (one worker)"
    if r == 0:
        return head + f"; ratio to exact 0 (exact all-reduce: {size_text(t.exact)})"
    less = f"{1 / r:.3g}x less" if r < 1 else f"{r:.3g}x more"
    return head + f"; ratio to exact {r:.3g} (exact all-reduce: {size_text(t.exact)}; {less})"
