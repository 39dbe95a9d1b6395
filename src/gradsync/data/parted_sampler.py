"""PartedStepSampler: non-IID data -- each block of ranks reads its own part of the training set.

:class:`StepSampler` cuts every step's global batch from one shuffled stream, so
every rank sees the same distribution (IID). Training across sites does not: each
site holds its own data. ``gradsync train --data-parts P`` emulates that. The
training indices are cut into ``P`` *contiguous* parts -- part ``p`` is
``[p*n//P, (p+1)*n//P)`` -- because contiguous windows of the built-in ``pysrc``
corpus are different source files, i.e. genuinely different distributions (an
interleaved cut would give every part the same mix again). The ``K`` ranks are cut
into ``P`` consecutive blocks of ``K/P``; torchrun numbers ranks host-major, so with
``P`` = number of hosts a block is one host's ranks.

Each part is a :class:`StepSampler` of its own over its ``n_p`` local indices,
``global_batch/P`` samples a step, with its own stream of epochs. Seeding: part
``p``'s epoch ``e`` is the permutation seeded with ``seed + e + p * 2**20``. Part 0
therefore has exactly the single stream's seeds (``P = 1`` *is* StepSampler), and
a part would need 2**20 epochs to reach the next part's seeds. Not a wider stride:
torch's CPU generator keeps only the low 32 bits of a seed (``manual_seed(3)`` and
``manual_seed(3 + 2**32)`` give the same permutation), so ``p * 2**32`` would give
every part of equal length the same order.

Step ``s``'s samples are the union of every part's next ``global_batch/P``
(:meth:`part_blocks`): they depend on ``P``, never on ``K``. The state is each
part's global ``(epoch, position)``, so a checkpoint continues on any ``K'`` that
``P`` divides. :meth:`next_block` orders the union for the run's ``K`` so that the
even split ``block[r::K]`` (``ShareBalancer``, ``StepSampler.share``) hands rank
``r = p*(K/P) + j`` the slice ``part_blocks[p][j::K/P]``: block ``p``'s ranks share
part ``p``'s samples exactly as today's ranks share a block, and nothing
downstream changes.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .step_sampler import StepSampler

PART_SEED_STRIDE = 2**20  # within the 32 seed bits torch's CPU generator keeps


def part_bounds(dataset_len: int, parts: int) -> list[tuple[int, int]]:
    """Part ``p``'s index range ``[p*n//P, (p+1)*n//P)``, for every ``p``."""
    return [(p * dataset_len // parts, (p + 1) * dataset_len // parts) for p in range(parts)]


def check_parts(parts: int, world: int, global_batch: int) -> None:
    """One-line refusal unless ``parts`` divides both the number of workers and the batch."""
    if not isinstance(parts, int) or parts < 1:
        raise UsageError(f"--data-parts must be an integer >= 1, got {parts!r}")
    if world % parts or global_batch % parts:
        raise UsageError(f"--data-parts {parts} must divide the number of workers ({world}) "
                         f"and --global-batch ({global_batch}): each part feeds a block of "
                         "workers with an equal share of every step")


class PartedStepSampler:
    """Each step's global batch, ``global_batch/P`` samples from every part's own stream.

    The same interface as :class:`StepSampler` (``next_block``, ``share``,
    ``state_dict``, ``load_state_dict``, ``dataset_len``); ``world`` is the run's
    number of ranks, used only to order the block for the even split.
    """

    def __init__(self, dataset_len: int, global_batch: int, parts: int, world: int,
                 seed: int = 0, shuffle: bool = True):
        if global_batch < 1 or world < 1:
            raise UsageError(f"global_batch and world must be >= 1, got {global_batch}, {world}")
        check_parts(parts, world, global_batch)
        if global_batch % world:
            raise UsageError(f"--global-batch {global_batch} is not a multiple of the "
                             f"{world} workers: with --data-parts every worker takes an "
                             "equal share of its part")
        self.dataset_len, self.global_batch = int(dataset_len), int(global_batch)
        self.parts, self.world = int(parts), int(world)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.bounds = part_bounds(self.dataset_len, self.parts)
        per = self.global_batch // self.parts
        small = [(p, hi - lo) for p, (lo, hi) in enumerate(self.bounds) if hi - lo < per]
        if small:
            p, size = small[0]
            raise UsageError(f"--data-parts {parts}: part {p} holds {size} of the "
                             f"{self.dataset_len} training samples, fewer than its "
                             f"{per} a step; every step needs distinct samples")
        self.streams = [StepSampler(hi - lo, per, seed=self.seed + p * PART_SEED_STRIDE,
                                    shuffle=self.shuffle)
                        for p, (lo, hi) in enumerate(self.bounds)]

    def part_blocks(self) -> list[list[int]]:
        """Every part's next ``global_batch/P`` indices (dataset indices); advances the state."""
        return [[lo + i for i in s.next_block()]
                for (lo, _), s in zip(self.bounds, self.streams)]

    def next_block(self) -> list[int]:
        """The step's global batch, ordered so that ``block[r::K]`` is rank ``r``'s share."""
        per_part = self.world // self.parts
        block = [0] * self.global_batch
        for p, samples in enumerate(self.part_blocks()):
            for j in range(per_part):
                block[p * per_part + j::self.world] = samples[j::per_part]
        return block

    share = staticmethod(StepSampler.share)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "parted", "parts": self.parts,
                "epochs": [s.epoch for s in self.streams],
                "positions": [s.position for s in self.streams],
                "seed": self.seed, "shuffle": self.shuffle, "dataset_len": self.dataset_len,
                "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue every part's stream from ``sd``, saved on any number of ranks."""
        if sd.get("kind") != "parted" or sd.get("parts") != self.parts:
            was = sd.get("parts", 1) if sd.get("kind") == "parted" else 1
            raise UsageError(f"cannot resume: the checkpoint's data came in {was} part(s), "
                             f"--data-parts is {self.parts}")
        for key in ("seed", "shuffle", "dataset_len"):
            mine, theirs = getattr(self, key), sd.get(key)
            if mine != theirs:
                raise UsageError(f"cannot resume PartedStepSampler: {key} differs (state has "
                                 f"{theirs!r}, this sampler has {mine!r})")
        for s, epoch, pos in zip(self.streams, sd["epochs"], sd["positions"], strict=True):
            s.load_state_dict({"epoch": epoch, "position": pos, "seed": s.seed,
                               "shuffle": s.shuffle, "dataset_len": s.dataset_len})


def make_step_sampler(dataset_len: int, global_batch: int, parts: int, world: int,
                      seed: int = 0) -> StepSampler | PartedStepSampler:
    """``--data-parts 1``: today's StepSampler itself (its checkpoints unchanged); else parted."""
    if parts == 1:
        return StepSampler(dataset_len, global_batch, seed=seed)
    return PartedStepSampler(dataset_len, global_batch, parts, world, seed=seed)
