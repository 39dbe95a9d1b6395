"""``--log tensorboard``: torch's ``SummaryWriter`` (tensorboard's event files) in ``RUN/tb``.

One scalar per metric, tagged with its metrics.jsonl name, at the step, stamped
with the step's wall-clock time. A resume writes into the same directory with
``purge_step`` = the checkpoint's step + 1, so TensorBoard hides what the earlier
attempt logged after the checkpoint and the curve has each step once.
"""

from __future__ import annotations

import os

from ....rundir import TENSORBOARD_DIR
from .base import Start, Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, start: Start):
        from torch.utils.tensorboard import SummaryWriter

        logdir = os.path.join(start.out, TENSORBOARD_DIR)
        # what an earlier attempt wrote after the checkpoint (or, new to this run, all of it)
        keep = start.step if start.saved is not None else 0
        purge = keep + 1 if os.path.isdir(logdir) else None
        self.writer = SummaryWriter(logdir, purge_step=purge)
        self.through = keep
        self.state = {"dir": TENSORBOARD_DIR}

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        wall = record.get("unix_time") or None
        for key, value in values.items():
            self.writer.add_scalar(key, value, step, walltime=wall)

    def close(self, finished: bool) -> None:
        self.writer.close()


def open_tracker(start: Start) -> Tracker:
    return TensorBoardTracker(start)
