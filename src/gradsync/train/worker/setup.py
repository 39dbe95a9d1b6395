"""Setting up one worker's part of a run: its plan, the task, the strategy, restored state.

The worker receives the resolved config (``config/resolve.py``) from whoever started
it. Rank 0 alone plans the run with the function the launcher's preflight uses
(``config/plan.plan_run``: the run directory checked and locked unless the launcher
holds the lock, the checkpoint verified, fresh / continue / finished decided, the
accumulation count); the plan -- or the one-line error -- is broadcast, so every rank
acts on the same answer and raises the same error: nobody is left waiting in a
collective. A worker group restarted after a failure plans again, from the newest
checkpoint.
"""

from __future__ import annotations

import os
import time

import torch

from ... import dist as gdist
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
from ..checkpoint.kept import Kept
from ..checkpoint.restarts import note_restart
from ..config.plan import RunPlan, check_data_size, plan_run, step_sampler
from ..config.run_config import RunConfig
from ..records.instrument import Instruments, baseline_rate_of
from ..records.progress import RunDisplay
from ..records.summary import repair_summary
from ..step.coordinator import LocalSteps
from ..step.monitor import Watch, check_watched
from ..step.straggler import Slowdown
from ..task.build import build_task
from ..task.init_from import init_weights
from ..task.loader import StepBatches
from ..task.optim import build_with_optimizer
from ..task.schedule import finished_line, lr_factor
from .faults import FaultInjector
from .session import Session


def _reset_files(cfg: RunConfig, plan: RunPlan) -> tuple[int | None, list[str]]:
    """Rank 0: cut metrics back to the checkpoint's step, without damaged lines; a finished
    mark no longer holds. Returns (the last step metrics held before, notes on lines dropped)."""
    path = os.path.join(cfg.run.out, METRICS)
    reached = max((r["step"] for r in read_metrics(path)[0] if isinstance(r.get("step"), int)),
                  default=None)
    _, dropped = rewrite_metrics(path, plan.step)
    for name in (SUMMARY,) + ((DRIFT,) if plan.action == "fresh" else ()):
        path = os.path.join(cfg.run.out, name)
        if os.path.exists(path):
            os.remove(path)
    return reached, dropped


def _plan(cfg: RunConfig, rank: int, world: int, prepared: bool, model_fn):
    """Rank 0 plans the run (``config/plan.plan_run``), every rank acts on its plan or
    raises its error: the same answer everywhere, nobody left waiting in a collective."""
    outcome: tuple = ("error", "rank 0 did not decide")
    lock = None
    if rank == 0:
        try:
            plan, lock = plan_run(cfg, world, locked=prepared, model_fn=model_fn)
            outcome = ("ok", plan)
        except UsageError as e:
            outcome = ("error", str(e))
    outcome = state.agree(outcome)
    if outcome[0] == "error":
        raise UsageError(outcome[1])
    return outcome[1], lock


def setup(cfg: RunConfig, model_fn=None, data_fn=None, faults: FaultInjector | None = None,
          prepared: bool = False, factories: dict | None = None) -> Session | None:
    """This rank's Session, or None when the run directory holds a finished run."""
    started = time.perf_counter()
    info = gdist.info()
    rank, world = info.rank, info.world_size
    faults = faults or FaultInjector()
    faults.attempt = gdist.restart_count()  # a fault fires in one attempt, not in every restart
    task = build_task(cfg, model_fn, data_fn, factories)
    plan, lock = _plan(cfg, rank, world, prepared, model_fn)
    if plan.action == "finished":
        if rank == 0:
            print(finished_line(cfg, plan.step, plan.schedule_steps, plan.notes), flush=True)
            if not prepared:
                repair_summary(cfg.run.out)
            if lock:
                lock.release()
        return None
    if plan.action == "fresh" and cfg.task.init_from:  # weights to start from, every rank
        init_weights(task.model, cfg.task.init_from, cfg.run.model, cfg.run.trust_checkpoint_code)
    n = len(task.data.train)
    check_data_size(cfg, n)
    check_watched(cfg.checkpoints.watched, task.data.metrics, task.data.eval)  # every rank alike
    # who takes part in each step, chosen once: this group alone, or replica groups (ft/)
    coordinate = quorum_step.coordinator_for(cfg) if cfg.ft.member else None
    strategy, sched = build_with_optimizer(  # a DiLoCo worker per group: ft's outer sync
        task, cfg, info.device, plan.schedule_steps,
        **(coordinate.strategy_options if coordinate else {}))
    sched = sched or torch.optim.lr_scheduler.LambdaLR(
        strategy.optimizer, lambda s: lr_factor(s, cfg, plan.schedule_steps))
    sess = Session(cfg, plan, rank, world, info.device, info.backend, task, strategy,
                   step_sampler(cfg, plan, n), sched, faults,
                   Instruments(cfg, rank, world, info.device),
                   os.path.join(cfg.run.out, CHECKPOINT), started, lock=lock)
    sess.slowdown = Slowdown(cfg.batch.stragglers, rank)
    sess.watch = Watch(cfg.checkpoints.best, cfg.checkpoints.stop)
    sess.kept = Kept(cfg.checkpoints.keep_last)
    sess.batches = StepBatches(task.data.train, task.data.collate_fn, cfg.task.loader_workers,
                               info.device, seed=cfg.run.seed * 65537 + rank)
    sess.coordinator = coordinate(sess) if coordinate else LocalSteps(
        cfg, plan, rank, say=lambda line: sess.display.say(line) if sess.display else None)
    sess.world_sizes = list(plan.world_sizes) if plan.action == "resume" else []
    if plan.action == "resume":
        with trusting(cfg.run.trust_checkpoint_code):  # every rank reads data only, unless opted in
            sess.start_step = sess.last_checkpoint = state.load(sess)
    if not sess.world_sizes or sess.world_sizes[-1] != world:
        sess.world_sizes.append(world)
    sess.coordinator.start()  # across groups: join the quorum (a heal may follow)
    if rank == 0:
        _open_rank0(sess)
    return sess


def _param_dtype(model: torch.nn.Module) -> str:
    """The dtype the model's floating parameters have (``float64``), which ``--precision
    fp32`` (the model's own dtype) trains in: the tables name it (``rundir.precision_text``)."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return str(max(set(dtypes), key=dtypes.count)).removeprefix("torch.") if dtypes else ""


def _open_rank0(sess: Session) -> None:
    cfg, plan = sess.cfg, sess.plan
    reached, dropped = _reset_files(cfg, plan)
    sess.param_dtype = _param_dtype(sess.task.model)
    write_json(os.path.join(cfg.run.out, CONFIG),
               {**cfg.record(plan.schedule_steps), "world_size": sess.world,
                "world_sizes": sess.world_sizes, "accumulation": plan.accumulation,
                "backend": sess.backend, "item_name": sess.unit,
                "eval": sess.task.data.eval is not None and cfg.observe.eval_every > 0,
                "param_dtype": sess.param_dtype})
    sess.writer = MetricsWriter(os.path.join(cfg.run.out, METRICS),
                                fail=lambda rec: sess.faults.write_error(0, rec.get("step")))
    sess.baseline_rate = baseline_rate_of(cfg)
    sess.display = RunDisplay(cfg.run.steps, sess.start_step, sess.unit)
    if sess.lock and sess.lock.note():
        sess.display.say(f"gradsync train: {sess.lock.note()}")
    if dropped:
        sess.display.say(f"gradsync train: {os.path.join(cfg.run.out, METRICS)}: dropped "
                         f"{len(dropped)} damaged line(s) ({'; '.join(dropped[:3])}) and "
                         "rewrote it without them")
    note_restart(sess, reached)
    for note in [*state.reconcile_kept(sess), *sess.watch.notes]:  # kept units, --keep-best
        sess.display.say(f"gradsync train: {note}")
    if plan.action == "resume":
        sess.inst.continue_drift(sess.start_step)
        workers = "1 worker" if sess.world == 1 else f"{sess.world} workers"
        sess.display.say(f"gradsync train: resuming from step {sess.start_step} of {cfg.run.steps} "
                         f"({workers}, was {plan.was_world})")
        for note in plan.notes:  # the schedule past its plan, the overrides applied
            sess.display.say(f"gradsync train: {note}")
    if cfg.observe.log:  # --log: the same records through each tracker too (records/trackers/)
        from ..records.trackers.fanout import open_trackers

        sess.writer = sess.trackers = open_trackers(
            sess.writer, {**cfg.record(plan.schedule_steps), "world_size": sess.world},
            plan.action == "resume", sess.start_step, plan.run_id, sess.display.say)
