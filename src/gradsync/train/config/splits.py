"""Which worker counts and micro-batches can carry a run's global batch.

A run's global batch is part of its identity (``state.MUST_MATCH``): the same
samples make each step on any number of workers. So when a continued run cannot
split it -- 16 samples on 3 workers -- suggesting another ``--global-batch`` (as a
fresh run's error does) sends the user straight into "a different run". The way
on is another number of workers, or another micro-batch: this lists those.
"""

from __future__ import annotations


def micro_batch_for(global_batch: int, workers: int, most: int) -> int | None:
    """The largest micro-batch <= ``most`` that splits ``global_batch`` over ``workers``."""
    if global_batch % workers:
        return None
    per_worker = global_batch // workers
    return next((m for m in range(min(most, per_worker), 0, -1) if per_worker % m == 0), None)


def continue_on(global_batch: int, micro_batch: int, workers: int, most: int = 8) -> str:
    """Ways to continue a run of ``global_batch`` samples a step that ``workers`` x
    ``micro_batch`` cannot split: e.g. "on 3 workers no micro-batch splits 16 samples;
    it continues on 1 worker with --micro-batch 8, 2 with 8, 4 with 4, 8 with 2 or
    16 with 1"."""
    here = micro_batch_for(global_batch, workers, micro_batch)
    plural = "" if workers == 1 else "s"
    if here is not None:
        return (f"on {workers} worker{plural} use --micro-batch {here} (or any that divides "
                f"{global_batch // workers})")
    ways = [(w, micro_batch_for(global_batch, w, micro_batch))
            for w in range(1, global_batch + 1) if global_batch % w == 0]
    shown = [f"{w} worker{'' if w == 1 else 's'} with --micro-batch {m}" if i == 0
             else f"{w} with {m}" for i, (w, m) in enumerate(ways[:most])]
    more = f", or more up to {ways[-1][0]}" if len(ways) > most else ""
    listed = ", ".join(shown[:-1]) + (f" or {shown[-1]}" if len(shown) > 1 else shown[0])
    return (f"on {workers} worker{plural} no micro-batch splits {global_batch} samples; "
            f"it continues on {listed}{more}")
