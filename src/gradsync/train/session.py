"""Setting up one worker's part of a run: directory, lock, resume decision, strategy, state.

Rank 0 alone looks at the run directory (checks it, locks it unless the launcher
already holds the lock, reads the checkpoint's header, verifies its checksums)
and decides: start fresh, continue, or say the run is already finished. The
decision -- or the one-line error -- is broadcast, so every rank acts on the
same answer and raises the same error: nobody is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field

import torch

from .. import dist as gdist
from ..data.balance import ShareBalancer
from ..data.parted_sampler import PartedStepSampler, make_step_sampler
from ..data.sampler import StepSampler
from ..engine.strategy.base import Strategy
from ..errors import UsageError
from ..rundir import (
    CHECKPOINT,
    CONFIG,
    DRIFT,
    METRICS,
    SUMMARY,
    MetricsWriter,
    read_metrics,
    rewrite_metrics,
    write_json,
)
from ..safeload import trusting
from . import ft_step, state
from .checkpoint import read_header, remove_stale_temporaries
from .config import TrainConfig
from .faults import FaultInjector
from .guard import RunLock, check_run_dir
from .instrument import Instruments, baseline_rate_of
from .optim import build_with_optimizer
from .parts_flags import check_data_parts_world
from .progress import RunDisplay
from .restarts import note_restart
from .save_size import space_needed
from .schedule import finished_line, lr_factor
from .straggler import Slowdown
from .task import Task, build_task


def _interrupt_on_sigterm() -> None:
    """The launcher stops workers with SIGTERM; unwind like Ctrl-C so cleanup runs."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


@dataclass
class Session:
    """Everything one worker holds for a run (built by :func:`setup`)."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    backend: str
    accum: int
    task: Task
    strategy: Strategy
    sampler: StepSampler | PartedStepSampler  # --data-parts P > 1: parted (non-IID)
    sched: torch.optim.lr_scheduler.LRScheduler
    faults: FaultInjector
    inst: Instruments
    plan: state.ResumePlan
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
    balancer: ShareBalancer | None = None  # each step's split over the ranks (train/step.py)
    slowdown: Slowdown | None = None  # --straggler: this rank's emulated slowness
    ft: object = None  # --ft-group: this rank's ReplicaGroup (ft/replica.py, ft_step.py)

    @property
    def unit(self) -> str:
        return self.task.data.item_name or "samples"

    def close(self) -> None:
        if self.ft:
            self.ft.shutdown()
        self.inst.close()
        if self.slowdown:
            self.slowdown.close()
        if self.writer:
            self.writer.close()
        if self.lock:
            self.lock.release()


def _prepare_run_dir(cfg: TrainConfig, prepared: bool, need: int | None):
    """Rank 0: check, lock, decide. Returns (ResumePlan, RunLock | None).

    ``prepared``: the launching process already checked the directory, verified
    the checkpoint and holds the lock (``gradsync train``, :func:`gradsync.train`).
    """
    if not prepared:
        check_run_dir(cfg.out, need, overwrite=cfg.overwrite)
    lock = None if prepared else RunLock(cfg.out).acquire()
    try:
        remove_stale_temporaries(cfg.out)
        path = os.path.join(cfg.out, CHECKPOINT)
        with trusting(cfg.trust_checkpoint_code):  # data only, unless the user opted in
            plan = state.decide(cfg, read_header(path))  # every byte verified before any use
        if lock:
            lock.claim()
    except BaseException:
        if lock:
            lock.release()
        raise
    return plan, lock


def _reset_files(cfg: TrainConfig, plan: state.ResumePlan) -> tuple[int | None, list[str]]:
    """Rank 0: cut metrics back to the checkpoint's step, without damaged lines; a finished
    mark no longer holds. Returns (the last step metrics held before, notes on lines dropped)."""
    path = os.path.join(cfg.out, METRICS)
    reached = max((r["step"] for r in read_metrics(path)[0] if isinstance(r.get("step"), int)),
                  default=None)
    _, dropped = rewrite_metrics(path, plan.step)
    for name in (SUMMARY,) + ((DRIFT,) if plan.action == "fresh" else ()):
        path = os.path.join(cfg.out, name)
        if os.path.exists(path):
            os.remove(path)
    return reached, dropped


def setup(cfg: TrainConfig, model_fn=None, data_fn=None, faults: FaultInjector | None = None,
          prepared: bool = False) -> Session | None:
    """This rank's Session, or None when the run directory holds a finished run."""
    started = time.perf_counter()
    info = gdist.info()
    rank, world = info.rank, info.world_size
    accum = None  # the same answer (or error) on every rank; the error after the decision,
    with contextlib.suppress(UsageError):  # as a continued run keeps its global batch
        accum = cfg.accumulation(world)
    slowdown = Slowdown(cfg.straggler, rank, world)  # likewise
    check_data_parts_world(cfg, world)  # the same on every rank: P divides K (parts_flags.py)
    _interrupt_on_sigterm()
    faults = faults or FaultInjector()
    faults.attempt = gdist.restart_count()  # a fault fires in one attempt, not in every restart
    task = build_task(cfg, model_fn, data_fn)
    outcome: tuple = ("error", "rank 0 did not decide")
    lock = None
    if rank == 0:
        try:
            need = None if prepared else space_needed(cfg, model_fn)
            plan, lock = _prepare_run_dir(cfg, prepared, need)
            outcome = ("ok", plan)
        except UsageError as e:
            outcome = ("error", str(e))
    outcome = state.agree(outcome)
    if outcome[0] == "error":
        raise UsageError(outcome[1])
    plan: state.ResumePlan = outcome[1]
    cfg.schedule_steps = plan.schedule_steps  # the run's own plan (schedule.py)
    if accum is None:
        if lock:
            lock.release()
        cfg.accumulation(world, resuming=plan.action != "fresh")  # raises, naming the ways on
    if plan.action == "resume" and cfg.sync != "exact" and plan.was_world not in (None, world):
        was = f"{plan.was_world} worker{'' if plan.was_world == 1 else 's'}"
        raise UsageError(f"{cfg.out} holds a --sync {cfg.sync} run of {was}, "
                         f"which continues on {plan.was_world} only (between syncs every worker "
                         f"holds its own replica and inner optimizer state); continue it with "
                         f"{was}: the same command with --nproc-per-node "
                         f"x --nnodes = {plan.was_world} (torchrun) or workers={plan.was_world}")
    if plan.action == "finished":
        if rank == 0:
            print(finished_line(cfg, plan.step, plan.schedule_steps), flush=True)
            if not prepared:
                from .api import repair_summary

                repair_summary(cfg.out)
            if lock:
                lock.release()
        return None
    n = len(task.data.train)
    if n < cfg.global_batch:
        raise UsageError(f"--data {cfg.data} holds {n} sample{'' if n == 1 else 's'}, fewer "
                         "than one global batch "
                         f"({cfg.global_batch}); every step needs distinct samples")
    strategy, sched = build_with_optimizer(task, cfg, info.device)  # train/optim.py
    sched = sched or torch.optim.lr_scheduler.LambdaLR(strategy.optimizer,
                                                       lambda s: lr_factor(s, cfg))
    sess = Session(cfg, rank, world, info.device, info.backend, accum, task, strategy,
                   make_step_sampler(n, cfg.global_batch, cfg.data_parts, world, cfg.seed),
                   sched,
                   faults, Instruments(cfg, rank, world, info.device), plan,
                   os.path.join(cfg.out, CHECKPOINT), started, lock=lock)
    # across replica groups the quorum deals the batch (ft_step.py): no balancer's split
    sess.balancer = (ShareBalancer(world, world, 1, enabled=False) if cfg.ft_group >= 0 else
                     ShareBalancer(world, cfg.global_batch, accum, enabled=cfg.balanced))
    sess.slowdown = slowdown
    sess.world_sizes = list(plan.world_sizes) if plan.action == "resume" else []
    if plan.action == "resume":
        with trusting(cfg.trust_checkpoint_code):  # every rank reads data only, unless opted in
            sess.start_step = sess.last_checkpoint = state.load(sess)
    if not sess.world_sizes or sess.world_sizes[-1] != world:
        sess.world_sizes.append(world)
    if cfg.ft_group >= 0:
        sess.ft = ft_step.attach(sess)
    if rank == 0:
        _open_rank0(sess)
    return sess


def _open_rank0(sess: Session) -> None:
    cfg, plan = sess.cfg, sess.plan
    reached, dropped = _reset_files(cfg, plan)
    write_json(os.path.join(cfg.out, CONFIG),
               {**cfg.to_dict(), "optimizer": cfg.optimizer_name, "world_size": sess.world,
                "world_sizes": sess.world_sizes, "accumulation": sess.accum,
                "backend": sess.backend, "item_name": sess.unit,
                "eval": sess.task.data.eval is not None and cfg.eval_every > 0})
    sess.writer = MetricsWriter(os.path.join(cfg.out, METRICS),
                                fail=lambda rec: sess.faults.write_error(0, rec.get("step")))
    sess.baseline_rate = baseline_rate_of(cfg)
    sess.display = RunDisplay(cfg.steps, sess.start_step, sess.unit)
    if sess.lock and sess.lock.note():
        sess.display.say(f"gradsync train: {sess.lock.note()}")
    if dropped:
        sess.display.say(f"gradsync train: {os.path.join(cfg.out, METRICS)}: dropped "
                         f"{len(dropped)} damaged line(s) ({'; '.join(dropped[:3])}) and "
                         "rewrote it without them")
    note_restart(sess, reached)
    if plan.action == "resume":
        workers = "1 worker" if sess.world == 1 else f"{sess.world} workers"
        sess.display.say(f"gradsync train: resuming from step {sess.start_step} of {cfg.steps} "
                         f"({workers}, was {plan.was_world})")
        for note in plan.notes:  # the schedule past its plan, the overrides applied
            sess.display.say(f"gradsync train: {note}")
    if cfg.log:  # --log: the same records through each tracker too (train/trackers/)
        from .trackers.fanout import open_trackers

        sess.writer = open_trackers(sess.writer, {**cfg.to_dict(), "world_size": sess.world,
                                                  "optimizer": cfg.optimizer_name},
                                    plan.action == "resume", sess.start_step, reached,
                                    plan.run_id, sess.display.say)
