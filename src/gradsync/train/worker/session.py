"""What one worker holds for a run: :class:`Session`, built by ``setup.py``, read by the rest.

The step, the loop, checkpoints, the summary and the quorum all take the session; a
module that only reads it imports this file, never the setup that builds it (which
needs most of ``train/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...data.parted_sampler import PartedStepSampler
from ...data.sampler import StepSampler
from ...engine.strategy.base import Strategy
from ...rundir import MetricsWriter
from ..checkpoint.guard import RunLock
from ..checkpoint.kept import Kept
from ..config.plan import RunPlan
from ..config.run_config import RunConfig
from ..records.instrument import Instruments
from ..records.progress import RunDisplay
from ..records.trackers.base import FINISHED, KILLED, Outcome
from ..records.trackers.fanout import TrackedWriter
from ..step.coordinator import StepCoordinator
from ..step.monitor import Watch
from ..step.straggler import Slowdown
from ..task.build import Task
from ..task.loader import StepBatches
from .faults import FaultInjector


@dataclass
class Session:
    """Everything one worker holds for a run (built by :func:`setup`)."""

    cfg: RunConfig  # the flags, resolved once (config/resolve.py)
    plan: RunPlan  # this run on this world: accumulation, fresh or resumed (config/plan.py)
    rank: int
    world: int
    device: torch.device
    backend: str
    task: Task
    strategy: Strategy
    sampler: StepSampler | PartedStepSampler  # --data-parts P > 1: parted (non-IID)
    sched: torch.optim.lr_scheduler.LRScheduler
    faults: FaultInjector
    inst: Instruments
    ckpt_path: str
    started: float
    start_step: int = 0
    world_sizes: list[int] = field(default_factory=list)
    lock: RunLock | None = None
    writer: MetricsWriter | None = None
    display: RunDisplay | None = None
    baseline_rate: float | None = None
    last_loss: float | None = None
    last_eval: float | None = None
    step_times: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    memory: object = None
    loop_started: float = 0.0
    last_checkpoint: int | None = None
    items_per_step: int = 0
    coordinator: StepCoordinator | None = None  # who takes part in each step (step/coordinator)
    slowdown: Slowdown | None = None  # --straggler: this rank's emulated slowness
    watch: Watch = field(default_factory=Watch)  # --keep-best, --early-stop (step/monitor)
    kept: Kept = field(default_factory=Kept)  # --keep-last (checkpoint/kept.py)
    batches: StepBatches | None = None  # the step's micro-batches, --loader-workers (task/loader)
    trackers: TrackedWriter | None = None  # --log (rank 0): also sess.writer
    finished: bool = False  # the run reached its end (the summary was written)
    param_dtype: str = ""  # the model's parameters' dtype (rank 0; config.json's)

    @property
    def unit(self) -> str:
        return self.task.data.item_name or "samples"

    def close(self, outcome: Outcome | None = None) -> None:
        """Let go of everything, the trackers marked with how the attempt ended (by default:
        finished if it reached its end, else killed, as a clean stop is)."""
        outcome = outcome or Outcome(FINISHED if self.finished else KILLED)
        if self.coordinator is not None:
            self.coordinator.close()
        self.inst.close()
        if self.slowdown:
            self.slowdown.close()
        if self.batches is not None:
            self.batches.close()
        if self.trackers:
            self.trackers.close(outcome)
        elif self.writer:
            self.writer.close()
        if self.lock:
            self.lock.release()
