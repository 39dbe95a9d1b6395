"""StepSampler: each optimizer step's global batch, the same whatever the number of ranks.

A per-rank position (``DistributedSampler``'s) cannot continue on another number
of ranks; a global position in one stream of epochs can, which is what lets
``gradsync train`` resume a run on K' workers that was checkpointed on K.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError


class StepSampler:
    """Each optimizer step's global batch, cut from one stream of epochs; any number of ranks.

    The stream is epoch 0's order, then epoch 1's, ... (the same per-epoch order as
    :class:`DistributedSampler`: a permutation seeded with ``seed + epoch``). Step
    ``s`` takes the stream's next ``global_batch`` indices, the *block*; rank ``r``
    of ``K`` takes the interleaved part ``block[r::K]``. The state is a *global*
    position -- ``(epoch, position in that epoch)`` -- and says nothing about
    ranks, so a run checkpointed on ``K`` workers continues on ``K'``: the same
    epoch, re-partitioned, and the set of samples in each step is the same
    whatever ``K`` is (with exact item weighting, ``backward(loss, num_items=n)``,
    so is the gradient). Within an epoch, rank ``r``'s indices are exactly those
    of ``DistributedSampler(mode="exact")``'s shard ``order[r::K]``, in order.

    Epoch boundary: a block that reaches the end of an epoch takes that epoch's
    last samples and the next epoch's first ones, so every step has exactly
    ``global_batch`` samples and, counted over the stream, every sample is used
    exactly once per epoch -- none repeated to pad, none dropped.
    """

    def __init__(self, dataset_len: int, global_batch: int, seed: int = 0, shuffle: bool = True):
        if dataset_len < 1:
            raise UsageError("StepSampler got an empty dataset (len 0): nothing to sample")
        if global_batch < 1:
            raise UsageError(f"global_batch must be >= 1, got {global_batch}")
        self.dataset_len = int(dataset_len)
        self.global_batch = int(global_batch)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def global_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=g).tolist()
            else:
                order = list(range(self.dataset_len))
            self._order = (epoch, order)
        return self._order[1]

    def next_block(self) -> list[int]:
        """The next step's global batch (every rank computes the same); advances the state."""
        block: list[int] = []
        while len(block) < self.global_batch:
            order = self.global_order(self.epoch)
            take = order[self.position:self.position + self.global_batch - len(block)]
            block += take
            self.position += len(take)
            if self.position == self.dataset_len:
                self.epoch, self.position = self.epoch + 1, 0
        return block

    @staticmethod
    def share(block: list[int], rank: int, world: int) -> list[int]:
        """Rank ``rank``'s interleaved part of ``block``."""
        if not 0 <= rank < world:
            raise UsageError(f"rank must be in [0, {world}), got {rank}")
        return block[rank::world]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "step", "epoch": self.epoch, "position": self.position,
                "seed": self.seed, "shuffle": self.shuffle, "dataset_len": self.dataset_len,
                "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from ``sd``, saved on any number of ranks; what fixes the order must match."""
        for key in ("seed", "shuffle", "dataset_len"):
            mine, theirs = getattr(self, key), sd.get(key)
            if mine != theirs:
                raise UsageError(f"cannot resume StepSampler: {key} differs (state has "
                                 f"{theirs!r}, this sampler has {mine!r})")
        pos = int(sd["position"])
        if not 0 <= pos < self.dataset_len:
            raise UsageError(f"StepSampler state position={pos} is outside the epoch "
                             f"(0..{self.dataset_len - 1})")
        self.epoch, self.position = int(sd["epoch"]), pos

    @classmethod
    def from_rank_states(cls, states: list[dict], global_batch: int) -> dict[str, Any]:
        """The global state equivalent to per-rank ``DistributedSampler(mode='exact')``
        states in which every rank drew the same count (what older checkpoints hold)."""
        yielded = {int(s["yielded"]) for s in states}
        epochs = {int(s["epoch"]) for s in states}
        if len(yielded) != 1 or len(epochs) != 1:
            raise UsageError("the checkpoint's per-worker sampler positions differ; it can "
                             "only continue on the same number of workers with an older gradsync")
        n, k = int(states[0]["dataset_len"]), len(states)
        epoch, pos = epochs.pop(), yielded.pop() * k
        if pos >= n:
            epoch, pos = epoch + 1, 0
        return {"kind": "step", "epoch": epoch, "position": pos, "seed": states[0]["seed"],
                "shuffle": states[0]["shuffle"], "dataset_len": n, "global_batch": global_batch}
