"""``--log tensorboard``: torch's ``SummaryWriter`` (tensorboard's event files) in ``RUN/tb``.

One scalar per metric, tagged with its metrics.jsonl name, at the step, stamped
with the step's wall-clock time. On opening, the steps ``RUN/tb`` already holds are
read back with tensorboard's own reader (``EventAccumulator``, which applies the
purges of earlier attempts): an attempt stopped before its writer flushed (every
120 s, or at a checkpoint here) holds fewer than it logged. The writer then opens
the same directory with ``purge_step`` = the last step held + 1 (at most the
checkpoint's), so TensorBoard hides what an earlier attempt logged after the
checkpoint, the steps it lacks are sent from metrics.jsonl, and the curve has each
step once.
"""

from __future__ import annotations

import logging
import os

from ....rundir import TENSORBOARD_DIR
from .base import HELD_KEY, Outcome, Start, Tracker


def held_steps(logdir: str) -> list[int]:
    """The steps of ``HELD_KEY`` TensorBoard shows for ``logdir`` (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    log = logging.getLogger("tensorboard")  # each purge is a warning: expected here
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        acc.Reload()
    finally:
        log.setLevel(level)
    if HELD_KEY not in acc.Tags().get("scalars", []):
        return []
    return [e.step for e in acc.Scalars(HELD_KEY)]


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, start: Start):
        from torch.utils.tensorboard import SummaryWriter

        logdir = os.path.join(start.out, TENSORBOARD_DIR)
        exists = os.path.isdir(logdir)
        held = [s for s in held_steps(logdir) if s <= start.step] if exists else []
        # every step up to the last one held is there (each attempt sends them in order)
        self.through = max(held, default=0)
        self.writer = SummaryWriter(logdir, purge_step=self.through + 1 if exists else None)
        self.state = {"dir": TENSORBOARD_DIR}

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        wall = record.get("unix_time") or None
        for key, value in values.items():  # HELD_KEY last (base.scalars)
            self.writer.add_scalar(key, value, step, walltime=wall)

    def commit(self, step: int) -> None:
        self.writer.flush()  # what a checkpoint holds survives a kill

    def close(self, outcome: Outcome) -> None:
        self.writer.close()


def open_tracker(start: Start) -> Tracker:
    return TensorBoardTracker(start)
