"""Saving a run and continuing it -- on the same number of workers or on another.

``checkpoint.pt`` (rank 0, atomic, CRC-checked on load) holds the step, the
scheduler, the sampler's *global* position (:class:`gradsync.data.StepSampler`:
no per-rank state, so it continues on any number of workers; with ``--data-parts
P`` every part's, ``data/parted_sampler.py``, on any multiple of P), the config, the
RNG state, the strategy's extra state and the unwrapped model (no ``module.``
prefixes; gathered in full for ZeRO-3), and on a GPU the GPU's generator too (dropout
there draws from it). With plain DataParallel it also holds
the optimizer state, identical on every rank. With ZeRO the optimizer state is
sharded, so each save writes a new sharded directory
``checkpoint-shards/step-N`` first (every rank its shard, manifest with SHA-256s
last) and only then replaces ``checkpoint.pt``, which names that directory;
older directories are removed afterwards. A crash at any point leaves a
``checkpoint.pt`` whose shards are complete. Sharded state is keyed by parameter
name and re-sharded on load (``engine/zero_checkpoint.py``), so ZeRO runs, too,
continue on a different number of workers.

What must match to continue a run (:data:`MUST_MATCH`) is what fixes its
trajectory: the model, the data (and its ``--data-parts``), the global batch, the
seed, the strategy, the precision. The number of workers and the micro-batch may
change (the global batch is then split differently, the set of samples in each
step is not), and
so may ``--steps``. The update rule -- learning rate, schedule and its planned
length, optimizer and its options, clipping -- changes only where ``--override``
names it (``identity.py``); a run continued past its planned schedule keeps it
(``task/schedule.py``).
"""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import dist as gdist
from ...data.sampler import StepSampler
from ...engine.sharded.checkpoint import load_sharded, save_sharded
from ...engine.transport import comm
from ...errors import UsageError
from ...rundir import SHARDS
from ..step.monitor import Watch, stopped_early
from ..task.schedule import planned_steps
from . import kept as kept_units
from .format import FORMAT, VERSION, atomic_save, load_checkpoint, storage_error
from .identity import check as check_identity
from .identity import optimizer_of
from .unit import config_digest, identity, new_run_id, shard_record

MUST_MATCH = ("model", "data", "seq_len", "global_batch", "seed", "strategy", "precision",
              "sync", "compress", "data_parts")
_OLD_DEFAULTS = {"strategy": "ddp", "precision": "fp32", "sync": "exact", "compress": "none",
                 "data_parts": 1}


@dataclass
class ResumePlan:
    """What rank 0 decided about the run directory, shared with every rank."""

    action: str  # "fresh" | "resume" | "finished"
    step: int = 0
    was_world: int | None = None
    world_sizes: tuple[int, ...] = ()
    run_id: str = ""  # drawn when the run starts fresh, kept by every resume (``unit.py``)
    schedule_steps: int = 0  # the schedule's planned length, the run's own (``task/schedule.py``)
    notes: tuple[str, ...] = ()  # what continuing does to the schedule, the overrides applied


def decide(cfg, header: dict | None) -> ResumePlan:
    """Fresh, resume or already finished, from ``--resume`` and the checkpoint's header
    (``cfg``: a resolved ``RunConfig``; ``config/plan.py``'s ``plan_run`` calls this).

    Raises UsageError (one line) when ``--resume must`` finds nothing, ``--resume
    never`` finds a checkpoint, or the checkpoint is of a different run.
    """
    out = cfg.run.out
    if header is None:
        if cfg.run.resume == "must":
            raise UsageError(f"--resume: no checkpoint in {out} to continue; leave out "
                             "--resume to start a new run there")
        return ResumePlan("fresh", run_id=new_run_id(),
                          schedule_steps=planned_steps(cfg))
    step, saved = int(header["step"]), header.get("config") or {}
    if cfg.run.resume == "never":
        raise UsageError(f"{out} already holds a checkpoint (step {step}); continue it by "
                         "leaving out --resume never, or choose another --out")
    flags = cfg.to_dict()
    for key in MUST_MATCH:
        was, now = saved.get(key, _OLD_DEFAULTS.get(key)), flags[key]
        if was != now:
            raise UsageError(f"{out} holds a checkpoint of a different run: --"
                             f"{key.replace('_', '-')} was {was!r}, now {now!r}; continue it "
                             "with the same flags, or choose another --out")
    planned, notes = check_identity(cfg, saved, header)  # lr, schedule, optimizer, ...
    sizes = tuple(header.get("world_sizes") or (header.get("world_size"),))
    run_id = header.get("run_id") or new_run_id()  # format 2 had none: one from now on
    stopped = stopped_early(header.get("watch"), cfg.checkpoints.stop)  # --early-stop's end
    action = "finished" if step >= cfg.run.steps or stopped else "resume"
    if stopped:
        watch = Watch(early_stop=cfg.checkpoints.stop)
        watch.load_state_dict(header.get("watch"))
        notes = [f"it {watch.stop_line()} (--early-stop {cfg.checkpoints.early_stop}; another "
                 "value, or none, continues it)"]
    return ResumePlan(action, step, header.get("world_size"), sizes, run_id, planned,
                      tuple(notes) if action == "resume" or stopped else ())


def device_rng_state(device: torch.device):
    """The accelerator's generator of ``device`` (dropout on a GPU draws from it, not
    from the CPU's), or None on the CPU."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device.type).get_rng_state(device)


def set_device_rng_state(device: torch.device, state) -> None:
    """Restore what :func:`device_rng_state` saved (nothing when either side was the
    CPU: a run saved on the CPU and continued on a GPU starts the GPU's generator from
    the seed)."""
    if state is None or device.type in ("cpu", "meta"):
        return
    torch.get_device_module(device.type).set_rng_state(state, device)


def run_digest(config: dict) -> str:
    """The configuration digest a checkpoint unit carries: what must match to continue."""
    return config_digest({**_OLD_DEFAULTS, **config, "optimizer": optimizer_of(config)},
                         (*MUST_MATCH, "optimizer"))


def save(sess, step: int) -> None:
    """Every rank calls it; rank 0 writes checkpoint.pt last (it makes the save current)."""
    cfg, strategy, rank = sess.cfg, sess.strategy, sess.rank
    shard_dir = None
    target = strategy.checkpoint_target
    record = cfg.record(sess.plan.schedule_steps)  # the flags, auto resolved, the run's plan
    ident = identity(sess.plan.run_id, step, run_digest(record))
    if target is not None:
        shard_dir = os.path.join(SHARDS, f"step-{step:07d}")
        path = os.path.join(cfg.run.out, shard_dir)
        try:
            save_sharded(path, *target, identity=ident)
        except OSError as e:
            raise storage_error(e, "the checkpoint shards", path) from None
    module_state = strategy.full_state_dict()  # a collective for ZeRO-3
    # every rank's generators (a collective): dropout on ranks of uneven work draws
    # differently, so rank 0's alone did not continue the other ranks bit for bit
    rngs = comm.all_gather_object({"cpu": torch.get_rng_state(),
                                   "device": device_rng_state(sess.device)}, tag="rng")
    last = sess.kept.after_save(step)  # --keep-last's list once this save is in place
    sess.kept.last, sess.kept.shards = last, shard_dir
    if rank != 0:
        sess.faults.at_save(rank, step)
        return
    shards = shard_record(cfg.run.out, shard_dir) if shard_dir else None
    atomic_save({"format": FORMAT, "version": VERSION, "step": step, "steps": cfg.run.steps,
                 "model": module_state, "optimizer": strategy.optimizer_state_dict(),
                 "optimizer_shards": shard_dir, "scheduler": sess.sched.state_dict(),
                 "sampler": sess.sampler.state_dict(), "balance": sess.coordinator.state_dict(),
                 "world_size": sess.world,
                 "world_sizes": list(sess.world_sizes),
                 "config": record,
                 "strategy_extra": strategy.extra_state(), "loss": sess.last_loss,
                 "rng": rngs[0]["cpu"], "device_rng": rngs[0]["device"],
                 "rng_by_rank": rngs, "unit": {**ident, "shards": shards},
                 "kept": sess.kept.state_dict(), "watch": sess.watch.state_dict()},
                sess.ckpt_path, before_replace=lambda: sess.faults.at_save(0, step))
    best = sess.watch.best if sess.watch.keep_best else None  # kept units (kept.py)
    kept_units.after_save(cfg.run.out, step, shard_dir, last, best, _watched(sess))
    if shard_dir:  # the previous steps' shards are no longer referenced
        root = os.path.join(cfg.run.out, SHARDS)
        for name in os.listdir(root):
            if name != os.path.basename(shard_dir):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load(sess) -> int:
    """Restore model, optimizer, scheduler, sampler, RNG and strategy state; return the step.

    Rank 0 verified the whole unit (``unit.py``: checksums, fields, the shards' identity)
    before the decision to resume was shared; the sharded load checks the identity again.
    """
    cfg, strategy = sess.cfg, sess.strategy
    state = load_checkpoint(sess.ckpt_path, verified=False)
    target = strategy.checkpoint_target
    if state.get("optimizer_shards"):
        if target is None:
            raise UsageError("the checkpoint holds sharded optimizer state but this strategy "
                             "is not sharded")
        unit = state.get("unit")  # format 3: the shards must be this unit's own
        expect = identity(unit["run_id"], unit["step"], unit["config_digest"]) if unit else None
        load_sharded(os.path.join(cfg.run.out, state["optimizer_shards"]), *target, expect=expect)
    else:
        strategy.load_full_state_dict(state["model"])
        try:
            strategy.load_optimizer_state_dict(state["optimizer"])
        except ValueError as e:  # torch: "... different number of parameter groups", sizes
            raise UsageError(
                f"{sess.ckpt_path}: its optimizer state does not fit the optimizer built now "
                f"({e}); a checkpoint written before biases and norms got their own no-decay "
                "parameter group holds one group where there are now two. Continue it with "
                "the gradsync version that wrote it, or start afresh in another --out") from None
    strategy.load_extra_state(state.get("strategy_extra") or {})
    base = list(sess.sched.base_lrs)  # the peak learning rates the flags give now
    sess.sched.load_state_dict(state["scheduler"])
    _follow_current_lr(sess.sched, base)
    if state.get("sampler") is not None:
        was, now = state["sampler"].get("dataset_len"), sess.sampler.dataset_len
        if was != now:
            raise UsageError(f"{cfg.run.out} holds a checkpoint of a run on {was} training "
                             f"samples; --data {cfg.run.data} now gives {now}: continue it on the "
                             "same data, or choose another --out")
        sess.sampler.load_state_dict(state["sampler"])
    else:  # an older checkpoint: every worker's DistributedSampler position
        sess.sampler.load_state_dict(StepSampler.from_rank_states(state["samplers"],
                                                                  cfg.batch.global_batch))
    by_rank = state.get("rng_by_rank")
    if by_rank and len(by_rank) == sess.world:  # the same workers: each its own generators
        torch.set_rng_state(by_rank[sess.rank]["cpu"])
        set_device_rng_state(sess.device, by_rank[sess.rank]["device"])
    else:  # another number of workers (or an older checkpoint): rank 0's, as before
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])
        set_device_rng_state(sess.device, state.get("device_rng"))
    sess.coordinator.load_state_dict(state.get("balance"))  # the split in force continues
    sess.watch.load_state_dict(state.get("watch"))  # best so far, patience (step/monitor.py)
    sess.kept.load_state_dict(state.get("kept"))
    sess.kept.shards = state.get("optimizer_shards")
    return int(state["step"])


def _watched(sess) -> str | None:
    return sess.watch.keep_best.spec if sess.watch.keep_best else None


def reconcile_kept(sess) -> list[str]:
    """Rank 0 at the start: ``RUN/checkpoints`` brought back to the kept lists of the
    checkpoint the run continues (``kept.reconcile``); notes for the user."""
    watch = sess.watch
    last, best, notes = kept_units.reconcile(sess.cfg.run.out, sess.start_step, sess.kept.shards,
                                             sess.kept.last, watch.best if watch.keep_best
                                             else None, _watched(sess))
    sess.kept.last = last
    if watch.keep_best:
        watch.best = best
    return notes


def _follow_current_lr(sched, base: list[float]) -> None:
    """The learning rate follows the flags given now, like the schedule does.

    The optimizer's and scheduler's saved state carry the old run's peak rate
    (``initial_lr``, ``base_lrs``) and its current rate; restored as they are, a
    changed ``--lr`` (allowed by ``--override lr``, ``identity.py``) would be ignored
    while config.json recorded it. Without an override the two agree anyway.
    """
    if not hasattr(sched, "lr_lambdas"):  # --scheduler: the user's own, restored as saved
        return
    sched.base_lrs = base
    for group, peak, factor in zip(sched.optimizer.param_groups, base, sched.lr_lambdas):
        group["initial_lr"] = peak
        group["lr"] = peak * factor(sched.last_epoch)


def agree(value, src: int = 0, device=None):
    """Rank ``src``'s (picklable, small) ``value`` on every rank, through engine/comm."""
    device = device or gdist.info().device
    data = pickle.dumps(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.broadcast(size, src, tag="agree_size")
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast(buf, src, tag="agree")
    return pickle.loads(buf.cpu().numpy().tobytes())
