"""Which samples of a step's global batch each rank of each group in the quorum takes.

Pure arithmetic, the same on every rank. The block (the step's global batch, a
fixed slice of the sampler's global order) is dealt over the quorum's ``Q x W``
ranks as one flat list, group by group: rank ``j`` of the group at quorum position
``r`` is slot ``r * W + j``. Counts differ by at most one (``data/split.py``'s
:func:`deal`, which gives ``block[k::Q*W]`` when they are equal), so a smaller
quorum hands every remaining rank more samples -- cut into more micro-batches of
at most ``--micro-batch`` -- and the step's batch stays the whole block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..data.split import deal, micro_batches
from ..errors import UsageError


def even_counts(total: int, parts: int) -> list[int]:
    """``total`` items over ``parts`` slots, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def quorum_share(block: Sequence[int], quorum: int, position: int, group_world: int,
                 rank: int) -> list[int]:
    """Rank ``rank``'s samples of ``block`` when its group is at ``position`` of ``quorum``."""
    if not 0 <= position < quorum:
        raise UsageError(f"quorum position must be in [0, {quorum}), got {position}")
    if not 0 <= rank < group_world:
        raise UsageError(f"rank must be in [0, {group_world}), got {rank}")
    slots = quorum * group_world
    return deal(block, even_counts(len(block), slots))[position * group_world + rank]


def micro_split(share: Sequence[int], block_len: int, slots: int,
                micro_batch: int) -> list[list[int]]:
    """``share`` cut into micro-batches of at most ``micro_batch``, as many as the
    largest share of the step takes: every rank of the quorum runs the same number
    (ZeRO-3 gathers parameters inside each forward, a collective)."""
    if micro_batch < 1:
        raise UsageError(f"micro-batch must be >= 1, got {micro_batch}")
    largest = math.ceil(block_len / slots)
    return micro_batches(share, max(1, math.ceil(largest / micro_batch)))
