"""ShareBalancer: each rank's share of the step's global batch, by its measured speed.

A synchronous step waits for its slowest rank. With the exact form of the
gradient -- per-item losses summed over every rank, divided by the global item
count (``backward(loss, num_items=n)``) -- ranks may take unequal shares and the
update is the same as the even split's (to float rounding). So a rank measured
slower is handed fewer samples; nothing about the model changes.

Contract (every rank, every step):

1. ``parts = balancer.split(block)`` -- the step's global block dealt to ranks by
   the split in force (:attr:`counts`); take ``parts[rank]`` and cut it with
   :meth:`micro_batches`. Every rank runs ``accumulation`` micro-batches (only
   their sizes differ), so collectives inside forward (ZeRO-3) stay matched.
2. After the backward passes, each rank's *busy* seconds -- its step time minus
   the time it was blocked in collectives, i.e. its own compute -- and its
   sample count reach every rank (``gradsync train`` carries them in the step's
   statistics all-gather; :meth:`gather` is the same for API users);
   ``balancer.observe(step, samples, busy)`` on every rank with those lists.

Because all ranks feed the same gathered numbers through the same arithmetic,
they agree on the next split without another message.

Guards against chasing noise: the first ``warmup`` steps of a session are not
measured (lazy initialisation, bucket rebuild); each rank's busy time is
modelled from its last ``window`` steps at each share it took
(:class:`~gradsync.data.speed.RankSpeeds`); the split
changes at most once per ``every`` steps and only when the predicted step time
(the slowest rank's under that model) improves by more than ``min_gain``; and a
change is on probation: if, measured over a window, it did not make the slowest
rank faster by half of ``min_gain``, the previous split comes back. Each
share stays within ``[min_share, max_share]`` times the even share (see
:func:`gradsync.data.split.bounds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..dist import comm_device
from ..engine.transport import comm, host
from ..errors import UsageError
from .speed import RankSpeeds
from .split import bounds, deal, micro_batches, split_counts, step_time


class ShareBalancer:
    """The split of each step's global batch over ``world`` ranks (see the module doc)."""

    def __init__(self, world: int, global_batch: int, accumulation: int = 1, *,
                 min_share: float = 0.2, max_share: float = 2.0, window: int = 5,
                 every: int = 5, min_gain: float = 0.1, warmup: int = 1,
                 enabled: bool = True):
        if global_batch % (world * accumulation):
            raise UsageError(f"global batch {global_batch} is not a multiple of {world} ranks x "
                             f"{accumulation} micro-batches")
        if not 0 < min_share <= 1 <= max_share:
            raise UsageError(f"need 0 < min_share <= 1 <= max_share, got {min_share}, "
                             f"{max_share}")
        if window < 1 or every < 1 or min_gain < 0 or warmup < 0:
            raise UsageError("window and every must be >= 1, min_gain and warmup >= 0")
        self.world, self.global_batch, self.accumulation = world, global_batch, accumulation
        self.lo, self.hi = bounds(global_batch, world, accumulation, min_share, max_share)
        self.window, self.every, self.min_gain, self.warmup = window, every, min_gain, warmup
        self.enabled = enabled
        self.counts = [global_batch // world] * world
        self.changes: list[tuple[int, list[int]]] = []  # (first step it applies to, counts)
        self.speeds = RankSpeeds(world, window)
        self.saved_s: float | None = None  # set by observe()
        self.last_rates: list[float] | None = None  # samples/s per rank, set by observe()
        self._last_change = -10**9
        self._skip = warmup
        self._trial: dict | None = None  # a change on probation: the split before, its time
        self._hold = -10**9  # no change before this step (after a reverted one)
        self.reverted = 0

    # -------------------------------------------------------------- the split
    @property
    def even(self) -> bool:
        return len(set(self.counts)) == 1

    def split(self, block: Sequence[int]) -> list[list[int]]:
        """Every rank's samples of this step's ``block`` (the same lists on every rank)."""
        if len(block) != self.global_batch:
            raise UsageError(f"the block holds {len(block)} samples, the global batch is "
                             f"{self.global_batch}")
        return deal(block, self.counts)

    def micro_batches(self, share: Sequence[int]) -> list[list[int]]:
        return micro_batches(share, self.accumulation)

    # -------------------------------------------------------------- measuring
    def rates(self) -> list[float] | None:
        """Samples per busy second of every rank at the split in force (recent steps)."""
        return self.speeds.rates(self.counts)

    def observe(self, step: int, samples: Sequence[float], busy_s: Sequence[float]) -> bool:
        """Record step ``step``'s per-rank samples and busy seconds; True: the split changed.

        The new split applies from step ``step + 1``. Also sets :attr:`saved_s`:
        the seconds this step saved against the even split (the slowest rank's
        modelled time on the even share minus the slowest measured busy time).
        """
        if len(samples) != self.world or len(busy_s) != self.world:
            raise UsageError(f"observe() needs one figure per rank ({self.world}), got "
                             f"{len(samples)} and {len(busy_s)}")
        self.saved_s = None
        if self._skip > 0:
            self._skip -= 1
            return False
        self.speeds.record(step, samples, busy_s)
        if self._settle_trial(step):
            return True
        fit = self.speeds.model([int(s) for s in samples])
        if fit is None:
            return False
        per, fixed = fit
        self.last_rates = [1.0 / b for b in per]
        even = [self.global_batch // self.world] * self.world
        self.saved_s = 0.0 if self.even else step_time(even, per, fixed) - max(busy_s)
        if (not self.enabled or self.speeds.measured(self.counts) < self.speeds.window
                or step - self._last_change < self.every or step < self._hold):
            return False
        proposal = split_counts(self.global_batch, per, self.lo, self.hi, fixed)
        if proposal == self.counts or step_time(proposal, per, fixed) > \
                step_time(self.counts, per, fixed) * (1 - self.min_gain):
            return False
        self._trial = {"counts": list(self.counts), "before": self.speeds.slowest(self.counts)}
        self.counts = proposal
        self._last_change = step
        self.changes.append((step + 1, list(proposal)))
        return True

    def _settle_trial(self, step: int) -> bool:
        """Keep a change only if it measurably helped; True: it was undone.

        Once the new split has a full window, its slowest rank's median busy time
        must beat the old split's by half of ``min_gain``; else the old split
        comes back and no change is tried for ``3 * every`` steps. The model
        proposes, the step times decide: a model misled by costs it cannot see
        costs one window, not the run.
        """
        if self._trial is None or self.speeds.measured(self.counts) < self.speeds.window:
            return False
        trial, self._trial = self._trial, None
        after, before = self.speeds.slowest(self.counts), trial["before"]
        if before is None or after is None or after <= before * (1 - self.min_gain / 2):
            return False
        self.counts = list(trial["counts"])
        self._last_change, self._hold = step, step + 3 * self.every
        self.changes.append((step + 1, list(self.counts)))
        self.reverted += 1
        return True

    def gather(self, samples: int, busy_s: float, group=None) -> tuple[list[float], list[float]]:
        """Every rank's (samples, busy seconds) through one small all-gather.

        For API users whose loop has no statistics gather of its own to carry them
        (``gradsync train`` sends them with its loss statistics instead).
        """
        mine = torch.tensor([float(samples), float(busy_s)], dtype=torch.float64,
                            device=comm_device(group))
        out = torch.empty(2 * self.world, dtype=torch.float64, device=mine.device)
        comm.all_gather_single(out, mine, group=group, tag="balance")
        out = host.read(out).tolist()  # one read of the device's values
        return out[0::2], out[1::2]

    # -------------------------------------------------------------- resuming
    def state_dict(self) -> dict[str, Any]:
        return {"world": self.world, "global_batch": self.global_batch,
                "accumulation": self.accumulation, "counts": list(self.counts),
                "changes": [[s, list(c)] for s, c in self.changes],
                "speeds": self.speeds.state_dict(),
                "last_change": self._last_change, "trial": self._trial, "hold": self._hold,
                "reverted": self.reverted}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue a balanced run; a different world or batch recipe starts even again."""
        if not state or (state.get("world"), state.get("global_batch"),
                         state.get("accumulation")) != (self.world, self.global_batch,
                                                        self.accumulation):
            return
        counts = [int(c) for c in state["counts"]]
        if sum(counts) != self.global_batch or not all(self.lo <= c <= self.hi for c in counts):
            return
        self.counts = counts
        self.changes = [(int(s), [int(x) for x in c]) for s, c in state.get("changes", [])]
        self.speeds.load_state_dict(state.get("speeds"))
        self._last_change = int(state.get("last_change", -10**9))
        self._trial = state.get("trial")
        self._hold = int(state.get("hold", -10**9))
        self.reverted = int(state.get("reverted", 0))
        self._skip = self.warmup  # the resumed session warms up again
