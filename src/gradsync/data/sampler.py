"""DistributedSampler: disjoint, deterministic, resumable per-rank shards.

The exactness proof of data parallelism (every rank's gradient is a piece of
the single-process gradient over the global batch) only holds when the shards
partition the data. This sampler produces those shards and lets you choose what
happens when the dataset size ``n`` does not divide by the number of replicas
``K``:

``pad``
    Wrap the epoch's order around until it has ``ceil(n/K)*K`` indices, so every
    shard has the same length. A few samples are seen twice per epoch. This is
    torch's default and keeps DDP's "average of per-rank means" convention
    unbiased between ranks, at the price of over-weighting the repeats.
``drop``
    Truncate the order to ``floor(n/K)*K`` indices: equal shards, no repeats,
    up to ``K-1`` samples skipped per epoch (different ones each epoch when
    shuffling).
``exact``
    Every index exactly once; shard sizes differ by at most one. Unequal shards
    are only correct when the loss is weighted by item count, which is what
    ``model.backward(loss, num_items=n)`` does: the engine all-reduces the sum of
    per-item gradients and the sum of counts, then divides by the global count,
    so the result is the single-process mean over all ``n`` items.

Every rank builds the same global order (a permutation seeded with
``seed + epoch``, or ``arange`` without shuffling) and takes the interleaved
slice ``order[rank::K]``, so no communication is needed to agree on shards.

``StepSampler`` (step_sampler.py, importable from here too) cuts the same
per-epoch orders into global batches by step, for runs that change their number
of ranks when they resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import UsageError
from .step_sampler import StepSampler

__all__ = ["MODES", "DistributedSampler", "StepSampler"]

MODES = ("pad", "drop", "exact")


def _default_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Fill in replicas/rank from the default process group, if there is one."""
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "DistributedSampler needs num_replicas and rank: pass them explicitly "
            "or initialise torch.distributed first (gradsync.init() / gradsync.spawn())"
        )
    if num_replicas is None:
        num_replicas = dist.get_world_size()
    if rank is None:
        rank = dist.get_rank()
    return num_replicas, rank


class DistributedSampler(Sampler[int]):
    """Yields this rank's shard of ``range(len(dataset))`` for the current epoch.

    ``dataset`` only needs ``len()``. Call ``set_epoch(e)`` before each epoch
    so the shuffle changes; every rank must use the same ``seed``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        mode: str = "pad",
    ) -> None:
        if mode not in MODES:
            raise UsageError(f"DistributedSampler mode must be one of {MODES}, got {mode!r}")
        num_replicas, rank = _default_world(num_replicas, rank)
        if num_replicas < 1:
            raise UsageError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise UsageError(f"rank must be in [0, {num_replicas}), got {rank}")
        n = len(dataset)
        if n == 0:
            raise UsageError("DistributedSampler got an empty dataset (len 0): nothing to shard")
        if mode == "drop" and n < num_replicas:
            raise UsageError(
                f"mode='drop' with {num_replicas} replicas and only {n} samples leaves every "
                f"shard empty; use fewer replicas, mode='pad' or mode='exact'"
            )
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.mode = mode
        self.epoch = 0
        self._offset = 0  # where the next __iter__ starts (set by load_state_dict)
        self._yielded = 0  # indices handed out so far in this epoch

    # -- shapes -------------------------------------------------------------
    @property
    def total_size(self) -> int:
        """Length of the padded/truncated global order for one epoch."""
        n, k = self.dataset_len, self.num_replicas
        if self.mode == "pad":
            return math.ceil(n / k) * k
        if self.mode == "drop":
            return (n // k) * k
        return n

    def num_samples_on(self, rank: int) -> int:
        """Shard size of ``rank`` (the same every epoch for a fixed dataset)."""
        if not 0 <= rank < self.num_replicas:
            raise UsageError(f"rank must be in [0, {self.num_replicas}), got {rank}")
        total, k = self.total_size, self.num_replicas
        return total // k + (1 if rank < total % k else 0)

    def __len__(self) -> int:
        return self.num_samples_on(self.rank)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``__iter__`` yields.

        Changing epoch discards a pending resume offset and the yielded count,
        because they refer to the previous epoch's order.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self._offset = 0
            self._yielded = 0
        self.epoch = epoch

    # -- order --------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> list[int]:
        """The padded/truncated order all ranks share for ``epoch``."""
        epoch = self.epoch if epoch is None else epoch
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self.total_size
        if total > n:  # pad: wrap around, repeatedly if n < K
            order = (order * math.ceil(total / n))[:total]
        return order[:total]

    def shard(self, epoch: int | None = None) -> list[int]:
        """This rank's indices for ``epoch`` (interleaved: ``order[rank::K]``)."""
        return self.global_order(epoch)[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # Set up eagerly (not inside the generator) so state_dict() is right
        # even before the first index is drawn.
        indices = self.shard()
        start, self._offset = self._offset, 0  # a resume applies to one pass only
        self._yielded = start
        return self._drain(indices[start:])

    def _drain(self, rest: list[int]) -> Iterator[int]:
        for i in rest:
            self._yielded += 1
            yield i

    # -- resume -------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch, plus what must match to resume.

        ``yielded`` counts indices this sampler handed out. A ``DataLoader``
        with worker prefetch pulls indices ahead of what training has used, so
        that count overshoots; pass ``consumed`` (the number of samples the
        training loop actually processed this epoch) to record that instead.
        """
        pos = self._yielded if consumed is None else int(consumed)
        if not 0 <= pos <= len(self):
            raise UsageError(f"consumed must be in [0, {len(self)}], got {pos}")
        return {
            "epoch": self.epoch,
            "yielded": pos,
            "seed": self.seed,
            "mode": self.mode,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume: the next ``__iter__`` yields exactly the rest of that epoch.

        The fields that define the order must match, otherwise the remaining
        indices would be a different set and the epoch would silently repeat or
        skip samples. ``rank`` is recorded but not checked, so a rank may adopt
        another's position. A state saved at the end of an epoch resumes to an
        empty pass; the loop then moves on with ``set_epoch(epoch + 1)``.
        Calling ``set_epoch`` with the saved epoch keeps the offset, so the
        usual ``for epoch in ...: sampler.set_epoch(epoch)`` loop resumes cleanly.
        """
        for key in ("seed", "mode", "shuffle", "num_replicas", "dataset_len"):
            mine, theirs = getattr(self, key), sd.get(key)
            if mine != theirs:
                raise UsageError(
                    f"cannot resume DistributedSampler: {key} differs "
                    f"(state has {theirs!r}, this sampler has {mine!r})"
                )
        pos = int(sd["yielded"])
        if not 0 <= pos <= len(self):
            raise UsageError(f"state yielded={pos} is outside this shard (size {len(self)})")
        self.epoch = int(sd["epoch"])
        self._offset = pos
        self._yielded = pos
