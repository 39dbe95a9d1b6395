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

import torch

from ... import dist as gdist
from ...data.balance import ShareBalancer
from ...data.parted_sampler import make_step_sampler
from ...errors import UsageError
from ...ft import quorum_step
from ...rundir import (
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
from ...safeload import trusting
from ..checkpoint import state
from ..checkpoint.format import remove_stale_temporaries
from ..checkpoint.guard import RunLock, check_run_dir
from ..checkpoint.restarts import note_restart
from ..checkpoint.size import space_needed
from ..checkpoint.unit import read_unit
from ..config.parts_flags import check_data_parts_world
from ..config.train_config import TrainConfig
from ..records.instrument import Instruments, baseline_rate_of
from ..records.progress import RunDisplay
from ..records.summary import repair_summary
from ..step.straggler import Slowdown
from ..task.build import build_task
from ..task.optim import build_with_optimizer
from ..task.schedule import finished_line, lr_factor
from .faults import FaultInjector
from .session import Session


def _interrupt_on_sigterm() -> None:
    """The launcher stops workers with SIGTERM; unwind like Ctrl-C so cleanup runs."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


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
            plan = state.decide(cfg, read_unit(path))  # every byte verified before any use
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
    check_data_parts_world(cfg, world)  # every rank alike: P divides K (config/parts_flags.py)
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
    cfg.schedule_steps = plan.schedule_steps  # the run's own plan (task/schedule.py)
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
                repair_summary(cfg.out)
            if lock:
                lock.release()
        return None
    n = len(task.data.train)
    if n < cfg.global_batch:
        raise UsageError(f"--data {cfg.data} holds {n} sample{'' if n == 1 else 's'}, fewer "
                         "than one global batch "
                         f"({cfg.global_batch}); every step needs distinct samples")
    strategy, sched = build_with_optimizer(task, cfg, info.device)  # train/task/optim.py
    sched = sched or torch.optim.lr_scheduler.LambdaLR(strategy.optimizer,
                                                       lambda s: lr_factor(s, cfg))
    sess = Session(cfg, rank, world, info.device, info.backend, accum, task, strategy,
                   make_step_sampler(n, cfg.global_batch, cfg.data_parts, world, cfg.seed),
                   sched,
                   faults, Instruments(cfg, rank, world, info.device), plan,
                   os.path.join(cfg.out, CHECKPOINT), started, lock=lock)
    # across replica groups the quorum deals the batch (ft/quorum_step.py): no balancer's split
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
        sess.ft = quorum_step.attach(sess)
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
    if cfg.log:  # --log: the same records through each tracker too (train/records/trackers/)
        from ..records.trackers.fanout import open_trackers

        sess.writer = open_trackers(sess.writer, {**cfg.to_dict(), "world_size": sess.world,
                                                  "optimizer": cfg.optimizer_name},
                                    plan.action == "resume", sess.start_step, reached,
                                    plan.run_id, sess.display.say)
