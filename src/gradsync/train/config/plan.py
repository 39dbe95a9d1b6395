"""The run planned on its workers: :func:`plan_run`, the one preparation of a run directory.

:func:`~gradsync.train.config.resolve.resolve` decides what follows from the flags
alone; what follows from the flags *and* the number of workers *and* the run
directory is decided here, by one function that the launcher's preflight and a
worker group's rank 0 both call (``launcher/preflight.py``, ``worker/setup.py``):

* the accumulation count: how many micro-batches of ``--micro-batch`` each worker
  runs so that the workers together take ``--global-batch`` (across replica groups,
  the count with every group present, rounded up: the quorum deals each step);
* the run directory: checked (owned, writable, room for a save), locked, cleared of a
  crashed save's temporaries, its checkpoint verified, and the decision made --
  fresh, continue, or already finished (``checkpoint/state.decide``) -- with the
  schedule's planned length the run keeps;
* the refusals that need those: a continued run's global batch that this number of
  workers cannot split (with the worker counts and micro-batches that can,
  :func:`continue_on`), ``--data-parts`` that does not divide the workers, a
  ``--straggler`` rank beyond them, a DiLoCo run continued on another number of
  workers, a dataset smaller than one global batch (:func:`check_data_size`).

The result, :class:`RunPlan`, is frozen; every rank of a worker group acts on rank 0's
(``checkpoint/state.agree``), so all raise the same error or none does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ...data.parted_sampler import check_parts, make_step_sampler
from ...errors import UsageError
from ...rundir import CHECKPOINT
from ...safeload import trusting
from ..checkpoint.format import remove_stale_temporaries
from ..checkpoint.guard import RunLock, check_run_dir
from ..checkpoint.kept import install, resolve_ref
from ..checkpoint.size import space_needed
from ..checkpoint.state import decide
from ..checkpoint.unit import read_unit
from ..task.init_from import source_kind
from .run_config import RunConfig


@dataclass(frozen=True)
class RunPlan:
    """What this run does on this world, from this run directory (rank 0's decision)."""

    world: int
    accumulation: int  # micro-batches per worker per step
    action: str  # "fresh" | "resume" | "finished"
    step: int = 0  # the checkpoint's step (0: fresh)
    was_world: int | None = None  # the workers that wrote the checkpoint
    world_sizes: tuple[int, ...] = ()
    run_id: str = ""  # drawn when the run starts fresh, kept by every resume (``unit.py``)
    schedule_steps: int = 0  # the schedule's planned length, the run's own (``task/schedule.py``)
    notes: tuple[str, ...] = ()  # what continuing does to the schedule, the overrides applied


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def micro_batch_for(global_batch: int, workers: int, most: int) -> int | None:
    """The largest micro-batch <= ``most`` that splits ``global_batch`` over ``workers``."""
    if global_batch % workers:
        return None
    per_worker = global_batch // workers
    return next((m for m in range(min(most, per_worker), 0, -1) if per_worker % m == 0), None)


def continue_on(global_batch: int, micro_batch: int, workers: int, most: int = 8) -> str:
    """Ways to continue a run of ``global_batch`` samples a step that ``workers`` x
    ``micro_batch`` cannot split: e.g. "on 3 workers no micro-batch splits 16 samples;
    it continues on 1 worker with --micro-batch 8, 2 with 8, 4 with 4, 8 with 2 or
    16 with 1".

    A run's global batch is part of its identity (``state.MUST_MATCH``): the same
    samples make each step on any number of workers. So suggesting another
    ``--global-batch`` to a continued run, as a fresh run's error does, would send the
    user into another run; the way on is another number of workers or micro-batch.
    """
    here = micro_batch_for(global_batch, workers, micro_batch)
    if here is not None:
        return (f"on {_workers(workers)} use --micro-batch {here} (or any that divides "
                f"{global_batch // workers})")
    ways = [(w, micro_batch_for(global_batch, w, micro_batch))
            for w in range(1, global_batch + 1) if global_batch % w == 0]
    shown = [f"{_workers(w)} with --micro-batch {m}" if i == 0 else f"{w} with {m}"
             for i, (w, m) in enumerate(ways[:most])]
    more = f", or more up to {ways[-1][0]}" if len(ways) > most else ""
    listed = ", ".join(shown[:-1]) + (f" or {shown[-1]}" if len(shown) > 1 else shown[0])
    return (f"on {_workers(workers)} no micro-batch splits {global_batch} samples; "
            f"it continues on {listed}{more}")


def accumulation(cfg: RunConfig, world: int, resuming: bool = False) -> int:
    """Micro-steps per optimizer step on ``world`` workers; the global batch must divide.

    ``resuming``: the global batch is the run's own, so the error lists the worker
    counts and micro-batches that split it (:func:`continue_on`), not other batches.
    Across replica groups the quorum deals each step's batch (``ft/shares.py``): the
    count with every group present, rounded up, and nothing has to divide.
    """
    batch, micro = cfg.batch.global_batch, cfg.batch.micro_batch
    if cfg.ft.groups:
        per_rank = -(-batch // (cfg.ft.groups * world))
        return max(1, -(-per_rank // micro))
    per_step = micro * world
    if batch % per_step == 0:
        return batch // per_step
    if resuming:
        raise UsageError(
            f"--global-batch {batch} is this run's, kept when it continues, and not a "
            f"multiple of --micro-batch {micro} x {_workers(world)} = {per_step}; "
            + continue_on(batch, micro, world))
    lower = max(per_step, batch // per_step * per_step)
    fits = [m for m in range(micro, 0, -1) if batch % (m * world) == 0]
    alt = f", or --micro-batch {fits[0]}" if fits else ""
    raise UsageError(f"--global-batch {batch} is not a multiple of --micro-batch {micro} x "
                     f"{_workers(world)} = {per_step}; try --global-batch {lower} or "
                     f"{lower + per_step}{alt}")


def step_sampler(cfg: RunConfig, plan: RunPlan, n: int):
    """Each step's global batch of ``n`` samples: the sampler this run draws its blocks from
    (``--data-parts`` P > 1: one stream per part, ``data/parted_sampler.py``)."""
    batch = cfg.batch
    return make_step_sampler(n, batch.global_batch, batch.data_parts, plan.world, cfg.run.seed)


def check_data_size(cfg: RunConfig, n: int) -> None:
    """Every step needs ``--global-batch`` distinct samples."""
    if n < cfg.batch.global_batch:
        raise UsageError(f"--data {cfg.run.data} holds {n} sample{'' if n == 1 else 's'}, "
                         f"fewer than one global batch ({cfg.batch.global_batch}); every step "
                         "needs distinct samples")


def _check_world(cfg: RunConfig, world: int) -> None:
    """What the number of workers must fit: ``--data-parts`` divides it (and the batch),
    every ``--straggler`` rank is one of its ranks."""
    if cfg.batch.data_parts != 1:
        check_parts(cfg.batch.data_parts, world, cfg.batch.global_batch)
    beyond = sorted({s.rank for s in cfg.batch.stragglers if s.rank >= world})
    if beyond:
        raise UsageError(f"--straggler names rank {beyond[0]}, but the run has {world} "
                         f"worker(s) (ranks 0..{world - 1})")


def _check_local_sync_world(cfg: RunConfig, was: int | None, world: int,
                            continue_with: Callable[[int], str]) -> None:
    """A DiLoCo run continues on the number of workers that wrote it."""
    if cfg.sync.method == "exact" or was in (None, world):
        return
    raise UsageError(f"{cfg.run.out} holds a --sync {cfg.sync.method} run of {_workers(was)}, "
                     f"which continues on {was} only (between syncs every worker holds its own "
                     f"replica and inner optimizer state); continue it with: "
                     f"{continue_with(was)}")


def same_command_on(workers: int) -> str:
    """How a run not launched by ``gradsync train`` continues on ``workers`` workers."""
    return (f"the same command on {_workers(workers)} (torchrun: --nproc-per-node x --nnodes "
            f"= {workers}; gs.train: workers={workers})")


def start_from(ref: str, out: str) -> None:
    """``--resume-from``: the checkpoint ``ref`` names becomes ``out``'s, verified first,
    when ``out`` holds none yet; a later launch of the same command finds it there and
    continues ``out`` (the unit's run, further on), as every resume does.

    The source is never written: the unit is linked or copied in (``kept.install``). Its run
    id is kept -- the run continues, in another directory -- and a source inside ``out``
    (rolling a run back onto itself) is refused: it would replace the newer checkpoint
    and the kept units after it.
    """
    src = resolve_ref(ref, "--resume-from")
    here = os.path.realpath(out)
    if os.path.commonpath([here, os.path.realpath(src)]) == here:
        raise UsageError(f"--resume-from {ref} is inside --out {out}: it continues a checkpoint "
                         "in a new run directory, leaving the source as it is; choose a new "
                         f"--out (or leave out --resume-from to continue {out} from its newest)")
    header = read_unit(os.path.join(src, CHECKPOINT))  # every byte, data only
    have = read_unit(os.path.join(out, CHECKPOINT))
    if have is None:
        install(src, out)
        return
    if have.get("run_id") != header.get("run_id") or have["step"] < header["step"]:
        raise UsageError(f"--out {out} already holds a checkpoint (step {have['step']}) of "
                         f"another run than --resume-from {ref} (step {header['step']}): choose "
                         f"a new --out, or leave out --resume-from to continue {out}")


def plan_run(cfg: RunConfig, world: int, *, locked: bool = False, model_fn=None,
             continue_with: Callable[[int], str] = same_command_on,
             before_directory: Callable[[], None] | None = None
             ) -> tuple[RunPlan, RunLock | None]:
    """Check, lock and read the run directory, decide, and plan the run on ``world`` workers.

    ``locked``: the launching process already checked the directory and holds its lock
    (``gradsync train``, ``gs.train``): only its checkpoint is read again (a restarted
    worker group continues from the newest one). ``continue_with(n)``: how the user
    continues on ``n`` workers, for the refusals that say so. ``before_directory``: the
    caller's own checks, made once the batch and the world are checked and before the
    directory is touched (the launcher's: devices, data size, port). Returns the plan and the
    lock this call took (None when ``locked``); the lock is released on any error.
    """
    out = cfg.run.out
    try:
        accum = accumulation(cfg, world)
    except UsageError:  # a continued run keeps its batch: said once its checkpoint is read
        if not os.path.exists(os.path.join(out, CHECKPOINT)):
            raise
        accum = None
    _check_world(cfg, world)
    if before_directory is not None:
        before_directory()
    lock = None
    if not locked:
        created = not os.path.exists(out)
        check_run_dir(out, space_needed(cfg, model_fn), overwrite=cfg.run.overwrite)
        lock = RunLock(out, created=created).acquire()
    try:
        remove_stale_temporaries(out)
        with trusting(cfg.run.trust_checkpoint_code):  # data only, unless the user opted in
            if cfg.checkpoints.resume_from:
                start_from(cfg.checkpoints.resume_from, out)
            decision = decide(cfg, read_unit(os.path.join(out, CHECKPOINT)))  # every byte
        if lock:
            lock.claim()  # gradsync's run directory from now on (guard.py)
        if accum is None:  # on resume: the worker counts and micro-batches that carry it
            accum = accumulation(cfg, world, resuming=decision.action != "fresh")
        if decision.action == "resume":
            _check_local_sync_world(cfg, decision.was_world, world, continue_with)
        notes = tuple(decision.notes)
        if cfg.task.init_from and decision.action == "fresh":
            source_kind(cfg.task.init_from)  # its kind, before any worker reads it
        elif cfg.task.init_from and decision.action == "resume":
            notes += (f"--init-from is for a fresh start; the run continues from its checkpoint "
                      f"(step {decision.step}) and does not read {cfg.task.init_from}",)
    except BaseException:
        if lock:
            lock.release()
        raise
    plan = RunPlan(world, accum, decision.action, decision.step, decision.was_world,
                   tuple(decision.world_sizes), decision.run_id, decision.schedule_steps,
                   notes)
    return plan, lock
