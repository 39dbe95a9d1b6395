"""PURE shard arithmetic for ZeRO: flat buffers cut into equal per-rank shards.

ZeRO (arXiv 1910.02054, section 5) partitions a flat buffer of parameters into N
equal contiguous pieces, one per data-parallel rank. Equal pieces are what a
reduce-scatter and an all-gather of one flat tensor need, so the buffer is padded
with zeros up to a multiple of N; a parameter may straddle two ranks and a rank may
hold nothing but padding (a model with fewer elements than ranks). The padding is
recorded here so memory reports can list it separately.

Gradients travel bucket by bucket (the DataParallel bucket plan), so each bucket is
its own flat buffer, sharded on its own. A rank's optimizer shard is the
concatenation of its slice of every bucket.

ZeRO's model-state formulas live beside the measured report they are compared
with (``replicated/memory_report.py``). No torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def padded_numel(numel: int, world: int) -> int:
    """Smallest multiple of ``world`` that holds ``numel`` elements (at least ``world``)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return max(1, -(-numel // world)) * world


@dataclass(frozen=True)
class Segment:
    """Part of one parameter that lies in a rank's shard.

    ``param`` indexes the flat buffer's parameter list; ``param_offset`` is where the
    piece starts inside the flattened parameter, ``shard_offset`` where it starts in
    the shard, ``numel`` its length.
    """

    param: int
    param_offset: int
    shard_offset: int
    numel: int


@dataclass(frozen=True)
class FlatShard:
    """One flat buffer of ``numels`` (in order) cut into ``world`` equal shards."""

    numels: tuple[int, ...]
    world: int

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        return padded_numel(self.numel, self.world)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of ``rank``'s shard in the padded flat buffer."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def real_numel(self, rank: int) -> int:
        """Elements of ``rank``'s shard that are parameters, not padding."""
        start, end = self.shard_range(rank)
        return max(0, min(end, self.numel) - start)

    def segments(self, rank: int) -> list[Segment]:
        """The pieces of parameters that fall into ``rank``'s shard, in order."""
        start, end = self.shard_range(rank)
        out: list[Segment] = []
        offset = 0
        for i, n in enumerate(self.numels):
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                out.append(Segment(i, lo - offset, lo - start, hi - lo))
            offset += n
        return out


def plan_flat_shards(bucket_numels: Sequence[Sequence[int]], world: int) -> list[FlatShard]:
    """One :class:`FlatShard` per bucket (each bucket lists its parameters' numels)."""
    return [FlatShard(tuple(int(n) for n in b), world) for b in bucket_numels]
