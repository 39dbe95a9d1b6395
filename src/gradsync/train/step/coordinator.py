"""How a step's global batch is dealt, summed and committed: one interface, chosen once.

A step of ``gradsync train`` takes a block of the sampler's global order and trains on
it exactly (``step/train_step.py``). Three things about that step depend on who takes
part in it, and only those: which samples this rank takes (the *deal*), whether the
gradient is summed beyond this worker group (the *reduction*), and whether the update
may happen (the *commit*). :class:`StepCoordinator` is that interface; worker setup
chooses its implementation once, and the step and the loop talk to it and to nothing
else about who takes part:

* :class:`LocalSteps` (here): the workers of this group are the whole run. The block
  is dealt evenly (``block[r::K]``) or, with ``--balance auto``, by measured speed
  (:class:`~gradsync.data.balance.ShareBalancer`, which it feeds after every step);
  the group's all-reduce is the whole sum; every step commits.
* ``ft/quorum_step.py`` and ``ft/local_groups.py`` (``--ft-group``): replica groups on
  torchft, each step (or each DiLoCo sync) through a quorum that deals the block over
  the groups alive, sums exactly across them, and may not commit (a group died): the
  step is then taken again on the same samples.

What the step needs back is plain data (shares, sums, a record's fields), so the
step has no branch on fault tolerance and no type probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ...data.balance import ShareBalancer
from ...data.split import deal, micro_batches


@runtime_checkable
class StepCoordinator(Protocol):
    """Who takes part in a step, as the step and the loop need to know it."""

    def begin(self, step: int) -> int:
        """The step to take now (``step``, or where a quorum says the run is)."""

    def deal(self, block: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        """This rank's samples of the step's ``block`` and its micro-batches (every rank
        of the step runs as many micro-batches: ZeRO-3 gathers inside each forward)."""

    def reduce(self, items: float, loss_sum) -> None:
        """After the backward: sum the gradient beyond this group, where there is one."""

    def totals(self, stats) -> tuple[float, float]:
        """The step's item count and loss sum, from the statistics every rank gathered
        (``records/instrument.STATS``, one row per rank)."""

    def problem(self, loss: float, step: int) -> str | None:
        """A non-finite ``loss`` seen only beyond this group, in words; None otherwise."""

    def commit(self) -> bool:
        """Whether the update may happen (False: take the step again, same samples)."""

    def observe(self, step: int, shares: list[int], busy: list[float]) -> float | None:
        """The step's measured shares and busy seconds; the seconds a split saved."""

    def record(self, report: dict) -> dict:
        """The strategy's ``step_report`` with what this coordinator adds to the record."""

    @property
    def world_size(self) -> int:
        """The ranks that trained the step."""

    def end_step(self, step: int, committed: bool) -> None:
        """After the step, committed or not (a quorum's announcements, a group's sync)."""

    def end(self) -> bool:
        """After the loop's last step: the run's end, agreed with whoever else takes part
        (across replica groups, ``ft/closing.py``); True when this rank received the last
        step's state there and must save its checkpoint."""

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of it (``"balance"``)."""

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from a checkpoint's ``state_dict``."""

    def start(self) -> None:
        """Once the session is restored: join whatever the steps go through."""

    def summary(self, rows: list[dict]) -> dict | None:
        """summary.json's figures of this coordinator over the run's metrics, or None."""

    def summary_line(self, figures: dict) -> str:
        """The closing table's line for :meth:`summary`'s figures."""

    def close(self) -> None:
        """The run is over (or failed): let go of what it holds."""


class LocalSteps:
    """This worker group is the whole run: every step commits, the block is dealt evenly
    (``block[r::K]``) or, with ``--balance auto``, by measured speed (``balancer``).

    ``cfg``: the resolved config (its ``batch`` section), ``plan``: the run on its
    workers (their number, the accumulation count); ``say``: a line for the user
    (rank 0's display), or None."""

    def __init__(self, cfg, plan, rank: int, say: Callable[[str], None] | None = None):
        batch, world = cfg.batch, plan.world
        self.rank, self.world, self.accumulation = rank, world, plan.accumulation
        self.counts = [batch.global_batch // world] * world
        self.balancer = (ShareBalancer(world, batch.global_batch, plan.accumulation)
                         if batch.balanced else None)
        self.say = say

    @property
    def world_size(self) -> int:
        return self.world

    def begin(self, step: int) -> int:
        return step

    def deal(self, block):
        if self.balancer is not None:
            share = self.balancer.split(block)[self.rank]
        else:
            share = deal(block, self.counts)[self.rank]
        return share, micro_batches(share, self.accumulation)

    def reduce(self, items, loss_sum) -> None:
        """The group's own all-reduce already summed the whole gradient."""

    def totals(self, stats):
        return float(stats[:, 1].sum()), float(stats[:, 0].sum())

    def problem(self, loss, step):
        return None  # every rank's loss is in the statistics the step checks itself

    def commit(self) -> bool:
        return True

    def observe(self, step, shares, busy):
        """Feed the balancer (every rank alike); a changed split, applied from the next
        step, is announced. None when not balancing."""
        b = self.balancer
        if b is None:
            return None
        if b.observe(step, shares, busy) and self.say:
            rates = ", ".join(f"{r:.0f}" for r in b.last_rates)
            self.say(f"gradsync train: from step {step + 1} the ranks take {b.counts} samples "
                     f"(measured {rates} samples/s)")
        return b.saved_s

    def record(self, report: dict) -> dict:
        return report

    def end_step(self, step, committed) -> None:
        pass

    def end(self) -> bool:
        return False  # nobody else: the last step is the end

    def state_dict(self):
        return None if self.balancer is None else self.balancer.state_dict()

    def load_state_dict(self, state) -> None:
        if self.balancer is not None:
            self.balancer.load_state_dict(state)  # the split in force continues

    def start(self) -> None:
        pass

    def summary(self, rows):
        return None

    def summary_line(self, figures) -> str:
        return ""

    def close(self) -> None:
        pass
