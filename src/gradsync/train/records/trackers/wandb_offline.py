"""``--log wandb``: a W&B run, offline, in ``RUN/wandb/`` (``wandb sync RUN/wandb/offline-run-*``).

Offline unless ``WANDB_MODE`` says otherwise (a user who exports ``WANDB_MODE=online``
and is logged in gets an online run: the choice is theirs, not the trainer's);
project ``$WANDB_PROJECT`` or ``gradsync``; the run is named after its directory
and its W&B id is gradsync's run id (the checkpoint's). The W&B run id is kept in ``trackers.json``,
so every resume and restart continues the same run (``resume="allow"``), each
attempt in its own ``offline-run-*`` folder, which ``wandb sync`` joins. Console
capture is off: the trainer's own progress display owns the terminal.
"""

from __future__ import annotations

import os

from .base import Start, Tracker


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, start: Start):
        import wandb

        run_id = (start.saved or {}).get("run_id") or start.run_id  # gradsync's: one identity
        settings = wandb.Settings(console="off", quiet=True, save_code=False)
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE") or "offline", dir=start.out,
            project=os.environ.get("WANDB_PROJECT") or "gradsync", name=start.name,
            id=run_id, resume="allow",
            settings=settings)
        self.run.config.update(start.config, allow_val_change=True)  # a resume's flags
        self.through = start.reached if start.saved else 0
        self.state = {"run_id": run_id, "project": self.run.project}

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        self.run.log(values, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


def open_tracker(start: Start) -> Tracker:
    return WandbTracker(start)
