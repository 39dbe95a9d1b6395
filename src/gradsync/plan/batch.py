"""The batch recipe: global batch in tokens -> samples -> accumulation per worker count.

The identity is ``gbs = mbs * grad_acc * dp`` (Megatron-LM's bookkeeping:
Narayanan et al., arXiv 2104.04473, run m = B / (b * d) micro-batches per
pipeline per step). Data
parallelism is parallel and accumulation is sequential, so the recipe uses as
many workers as it can and fills the gap with accumulation; a worker count whose
accumulation falls below one cannot keep the global batch (it would have to shrink
the micro-batch, grow the global batch, or leave workers idle) and is flagged.

Rounding to a power of two is optional and takes the *nearest* power of two in
log space: a 4M-token global batch at 4096 tokens per sample is 976 samples,
rounded to 1024.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class BatchRow:
    """One worker count: how many micro-steps each worker runs per optimizer step."""

    workers: int
    grad_accum: float  # exact ratio samples / (mbs * workers); may be fractional
    grad_accum_steps: int  # whole micro-steps to run (ceil, at least 1)
    samples_per_step: int  # mbs * grad_accum_steps * workers actually processed
    below_one: bool  # too many workers: accumulation < 1
    exact: bool  # samples divide evenly into mbs * workers


@dataclass(frozen=True)
class BatchPlan:
    global_tokens: float
    seq_len: int
    micro_batch: int
    samples_exact: float  # tokens / seq_len before rounding
    samples: int  # the global batch in samples actually used
    rounded: bool
    rows: tuple[BatchRow, ...]


def nearest_power_of_two(x: float) -> int:
    """Nearest power of two in log space (976 -> 1024, 700 -> 512)."""
    if x <= 0:
        raise UsageError(f"cannot round {x} to a power of two")
    return 2 ** max(0, round(math.log2(x)))


def plan_batch(
    global_tokens: float,
    seq_len: int,
    micro_batch: int,
    workers: list[int],
    round_pow2: bool = True,
) -> BatchPlan:
    """Samples per step and accumulation steps for each worker count."""
    if global_tokens <= 0:
        raise UsageError(f"global batch must be > 0 tokens, got {global_tokens}")
    if seq_len <= 0:
        raise UsageError(f"sequence length must be >= 1, got {seq_len}")
    if micro_batch <= 0:
        raise UsageError(f"micro-batch must be >= 1, got {micro_batch}")
    if not workers or any(w <= 0 for w in workers):
        raise UsageError(f"worker counts must be >= 1, got {workers}")
    exact = global_tokens / seq_len
    if round_pow2:
        samples = nearest_power_of_two(exact)
    else:
        samples = int(exact)
        if samples < 1:
            raise UsageError(
                f"global batch of {global_tokens:g} tokens is less than one sequence of {seq_len}"
            )
    rows = []
    for w in workers:
        ratio = samples / (micro_batch * w)
        steps = max(1, math.ceil(ratio - 1e-12))
        rows.append(
            BatchRow(
                workers=w,
                grad_accum=ratio,
                grad_accum_steps=steps,
                samples_per_step=steps * micro_batch * w,
                below_one=ratio < 1,
                exact=samples % (micro_batch * w) == 0,
            )
        )
    return BatchPlan(global_tokens, seq_len, micro_batch, exact, samples, round_pow2, tuple(rows))
