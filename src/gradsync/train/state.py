"""Saving and resuming a training run, for every strategy.

``checkpoint.pt`` (rank 0, atomic) always holds the step, scheduler, every rank's
sampler position, the config and the unwrapped model (no ``module.`` prefixes;
gathered in full for ZeRO-3). With plain DataParallel it also holds the optimizer
state, identical on every rank. With ZeRO the optimizer state is sharded, so each
save writes a new sharded directory ``checkpoint-shards/step-N`` first (every rank
its shard, manifest last) and only then replaces ``checkpoint.pt``, which names
that directory; older directories are removed afterwards. A crash at any point
leaves a ``checkpoint.pt`` whose shards are complete.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from ..engine.fsdp import FullyShardedDataParallel
from ..engine.zero_checkpoint import load_sharded, save_sharded
from ..errors import UsageError
from .checkpoint import atomic_save, load_checkpoint

SHARDS = "checkpoint-shards"
MUST_MATCH_ON_RESUME = ("model", "data", "seq_len", "global_batch", "micro_batch", "seed",
                        "strategy", "precision")


def _sharded(cfg) -> bool:
    return cfg.strategy != "ddp"


def _shard_target(model, opt):
    """save_sharded/load_sharded take (ZeroOptimizer) or (FSDP model, its optimizer)."""
    if isinstance(model, FullyShardedDataParallel):
        return model, opt
    return opt, None


def _module_state(model) -> dict:
    if isinstance(model, FullyShardedDataParallel):
        return model.full_state_dict()  # a collective: every rank calls it
    return model.module.state_dict()


def agree(flag: bool, device) -> bool:
    """Rank 0 decides; every rank learns the decision (so all raise together)."""
    import torch

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def save(cfg, ckpt_path, step, world, model, opt, sched, sampler, loss) -> None:
    samplers = [None] * world
    dist.all_gather_object(samplers, sampler.state_dict())
    shard_dir = None
    if _sharded(cfg):
        shard_dir = os.path.join(SHARDS, f"step-{step:07d}")
        target, optimizer = _shard_target(model, opt)
        save_sharded(os.path.join(cfg.out, shard_dir), target, optimizer)
    module_state = _module_state(model)
    if dist.get_rank() != 0:
        return
    atomic_save({"format": "gradsync-checkpoint", "version": 1, "step": step,
                 "model": module_state,
                 "optimizer": None if shard_dir else opt.state_dict(),
                 "optimizer_shards": shard_dir, "scheduler": sched.state_dict(),
                 "samplers": samplers, "world_size": world, "config": cfg.to_dict(),
                 "loss": loss}, ckpt_path)
    if shard_dir:  # the previous steps' shards are no longer referenced
        root = os.path.join(cfg.out, SHARDS)
        for name in os.listdir(root):
            if name != os.path.basename(shard_dir):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def resume(cfg, ckpt_path, world, rank, model, opt, sched, sampler, device) -> int:
    """Return the step to start from (0 for a fresh run); restores everything else."""
    exists = agree(os.path.exists(ckpt_path), device)
    if cfg.resume and not exists:
        raise UsageError(f"--resume: no checkpoint at {ckpt_path}")
    if not cfg.resume:
        if exists:
            raise UsageError(f"{cfg.out} already holds a checkpoint; pass --resume to continue "
                             "it or choose another --out")
        return 0
    state = load_checkpoint(ckpt_path)
    if state.get("world_size") != world:
        raise UsageError(f"checkpoint {ckpt_path} was written by {state.get('world_size')} "
                         f"workers; resume with {state.get('world_size')} (this run has {world}): "
                         "every worker's sampler position is part of the run")
    for key in MUST_MATCH_ON_RESUME:
        saved = state["config"].get(key, "ddp" if key == "strategy" else
                                    "fp32" if key == "precision" else None)
        if saved != getattr(cfg, key):
            raise UsageError(f"cannot resume: --{key.replace('_', '-')} was {saved!r}, "
                             f"now {getattr(cfg, key)!r}")
    if state.get("optimizer_shards"):
        target, optimizer = _shard_target(model, opt)
        load_sharded(os.path.join(cfg.out, state["optimizer_shards"]), target, optimizer)
    else:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["samplers"][rank])
    return int(state["step"])
