"""One worker's part of ``gradsync eval``: a checkpoint's model scored on the held-out set.

The score is the training loop's own evaluation (``step/train_step.evaluate``: the exact
mean loss over the whole held-out set and ``TrainData.metrics`` over it, one all-reduce),
run on a model set up as the run's was, so that on the run's number of workers it is the
same number, bit for bit, as the run's ``eval_loss`` at that step:

* the task is built from the run's flags, seeded as the run was (``task/build.py``);
* the checkpoint's model state -- the values the run's forward computed with: bf16 in a
  bf16 run, whose fp32 masters only the optimizer reads; the consolidated model for ZeRO-3
  -- is loaded into the module *before* the strategy wraps it, as ``--init-from`` is, so
  every strategy (ZeRO-3's shards too) starts from it and computes as the run did;
* the strategy is the run's (its precision, its sharding: a ZeRO-3 forward gathers as the
  run's did), with a stand-in optimizer that never steps: an evaluation reads no optimizer
  state, and a ``--optimizer pkg.module:factory`` the run recorded is never imported on
  the run directory's word;
* each rank takes the held-out samples ``r, r + K, ...`` a training step's share at a
  time, so the sums are added in the run's order.

A local-update run (DiLoCo) between syncs held a replica per rank, and its ``eval_loss``
mixed them; its checkpoint's model is rank 0's replica, which every rank scores here (the
end of a run follows its final sync, where they are one model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ... import dist as gdist
from ...engine.strategy.base import Strategy
from ...errors import UsageError
from ...rundir import CHECKPOINT
from ...safeload import trusting
from ..checkpoint.format import load_checkpoint
from ..config.run_config import RunConfig
from ..step.train_step import evaluate
from ..task.build import Task, build_task
from ..task.optim import build_with_optimizer


@dataclass
class EvalTarget:
    """What :func:`~gradsync.train.step.train_step.evaluate` reads of a worker."""

    task: Task
    strategy: Strategy
    rank: int
    world: int
    device: torch.device


@torch.no_grad()
def _load_model(model: nn.Module, state: dict, where: str) -> None:
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        raise UsageError(f"the checkpoint {where} does not fit the model built for it "
                         f"({lines[1] if len(lines) > 1 else lines[0]}): is --model the "
                         "run's?") from None


def run_eval(cfg: RunConfig, unit: str, model_fn=None, data_fn=None,
             trust: bool = False) -> dict | None:
    """Score the checkpoint in ``unit`` (a directory holding ``checkpoint.pt``, verified by
    the caller) on the held-out set; rank 0 returns {"eval_loss", "eval_metrics",
    "held_out"}, the others None."""
    info = gdist.info()
    task = build_task(cfg, model_fn, data_fn)  # seeded as the run was
    if task.data.eval is None:
        raise UsageError(f"--data {cfg.run.data} has no held-out set to score the checkpoint on "
                         "(a TrainData with eval=...; the built-in datasets hold one out)")
    path = os.path.join(unit, CHECKPOINT)
    with trusting(trust):
        state = load_checkpoint(path, verified=False)
    _load_model(task.model, state, path)
    strategy, _ = build_with_optimizer(task, cfg, info.device, 1)  # a stand-in: never steps
    share = max(1, cfg.batch.global_batch // info.world_size)  # a training step's, as the run's
    target = EvalTarget(task, strategy, info.rank, info.world_size, info.device)
    loss, metrics = evaluate(target, share)
    if info.rank != 0:
        return None
    return {"eval_loss": loss, "eval_metrics": metrics, "held_out": len(task.data.eval)}
