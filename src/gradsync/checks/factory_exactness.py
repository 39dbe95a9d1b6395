"""`gradsync verify --model/--data`: the exactness check on the user's own model and data.

The built-in check (``checks.exactness``) shows that K workers reproduce one process
on a tanh regressor. The question a user has is whether that holds for *their*
model, loss and data layout: token losses with padding, dict inputs, transformers'
``labels``, a TrainData's own ``loss_fn``/``items_fn``. So this takes the factories
``gradsync train`` takes, read with train's conventions (``build_task``), and trains
the same global batch (the first ``samples`` samples) three ways on K processes --
even shards with ``num_items``, uneven shards with plain ``loss.backward()`` (the
average of per-rank means, DDP's convention) and uneven shards with ``num_items``
-- and once on one process over the whole batch, then compares the parameters.

Decisions (docs/train.md says them too):

* float64: the model and the floating inputs and targets are cast to it, so a gap
  at 1e-12 is a wrong sum and not rounding. A model that cannot run in float64
  is refused in one line.
* ``eval()`` mode on both sides: dropout would draw different masks on K
  processes than on one, and batch norm would normalise each rank's shard by its
  own statistics (a real difference, which SyncBatchNorm exists for, but not the
  one this check is about: the gradient sum and its weighting).
* plain SGD, ``lr``, a few steps (default 3): the check is of the gradient, and an
  optimizer with state would only carry the same gradients further.
* the single process runs first, in the calling process, so a model or data that
  fails at all fails there, in one line, before any worker starts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UsageError
from .exactness import _max_diff, uneven_shards


@dataclass(frozen=True)
class FactoryCheckConfig:
    model: str
    data: str
    workers: int = 2
    samples: int = 16
    steps: int = 3
    lr: float = 0.02
    tolerance: float = 1e-12
    seed: int = 0

    def __post_init__(self):
        for name in ("workers", "samples", "steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{'n' if name == 'samples' else name} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.samples < 2 * self.workers:
            raise UsageError(f"--n {self.samples} is too few for {self.workers} workers: the "
                             f"uneven split needs at least {2 * self.workers} samples")
        if not self.lr > 0 or not self.tolerance > 0:
            raise UsageError("--lr and --tolerance must be > 0")


@dataclass(frozen=True)
class FactoryCheckResult:
    config: FactoryCheckConfig
    max_drift: float
    max_gap: float
    uneven_shard_sizes: tuple[int, ...]
    uneven_gap_mean_of_means: float
    uneven_gap_num_items: float
    item_name: str

    @property
    def passed(self) -> bool:
        return (self.max_drift == 0.0 and self.max_gap <= self.config.tolerance
                and self.uneven_gap_num_items <= self.config.tolerance)


def _double(obj):
    """Floating tensors cast to float64 inside dicts, tuples and lists."""
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, Mapping):
        return {k: _double(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_double(v) for v in obj)
    return obj


def _forward(model, x):
    return model(**x) if isinstance(x, Mapping) else model(x)


def _task(cfg: FactoryCheckConfig):
    """Model (float64, eval mode) and completed data, as ``gradsync train`` reads them."""
    from ..train.config.train_config import TrainConfig
    from ..train.task.build import build_task

    tc = TrainConfig(model=cfg.model, data=cfg.data, seed=cfg.seed, out=".").resolved()
    task = build_task(tc)
    if len(task.data.train) < cfg.samples:
        raise UsageError(f"--data {cfg.data} holds {len(task.data.train)} samples; --n "
                         f"{cfg.samples} needs that many")
    try:
        task.model.double()
    except Exception as e:  # noqa: BLE001 - any failure to cast is the same answer
        raise UsageError(f"--model {cfg.model} cannot be cast to float64 ({type(e).__name__}: "
                         f"{e}); verify compares in float64") from None
    task.model.eval()
    return task


def _loss(task, model, idx):
    x, y = _double(task.collate(task.data.train, [int(i) for i in idx]))
    return task.data.loss_fn(_forward(model, x), y), task.items(x, y)


def train_single(cfg: FactoryCheckConfig, init: dict | None = None):
    """One process, the whole batch; returns (parameters, initial state, item name)."""
    task = _task(cfg)
    model = task.model
    if init is not None:
        model.load_state_dict(init)
    start = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps):
        try:
            loss, _ = _loss(task, model, range(cfg.samples))
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's model or data failed: one line
            raise UsageError(f"--model {cfg.model} on --data {cfg.data} failed in float64: "
                             f"{type(e).__name__}: {e}") from None
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    return params, start, task.data.item_name or "items"


def _replica_run(task, dp, init, shards, use_items: bool, cfg):
    import torch.distributed as dist

    dp.module.load_state_dict(init)
    opt = torch.optim.SGD(dp.parameters(), lr=cfg.lr)
    idx = shards[dist.get_rank()]
    for _ in range(cfg.steps):
        loss, n = _loss(task, dp, idx)
        if use_items:
            dp.backward(loss, num_items=n)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in dp.module.parameters()]


def _replica_job(cfg: FactoryCheckConfig, init: dict):
    from ..engine.replicated.data_parallel import DataParallel

    task = _task(cfg)
    task.model.load_state_dict(init)
    dp = DataParallel(task.model)
    even = np.array_split(np.arange(cfg.samples), cfg.workers)
    uneven = uneven_shards(cfg.samples, cfg.workers)
    return (_replica_run(task, dp, init, even, True, cfg),
            _replica_run(task, dp, init, uneven, False, cfg),
            _replica_run(task, dp, init, uneven, True, cfg))


def run_factory_check(cfg: FactoryCheckConfig) -> FactoryCheckResult:
    """One process first (a broken model fails here), then ``cfg.workers`` processes."""
    from ..launch import spawn

    single, init, item_name = train_single(cfg)
    results = spawn(_replica_job, cfg.workers, cfg, init)
    even = [r[0] for r in results]
    return FactoryCheckResult(
        config=cfg,
        max_drift=max((_max_diff(even[0], e) for e in even[1:]), default=0.0),
        max_gap=_max_diff(even[0], single),
        uneven_shard_sizes=tuple(len(s) for s in uneven_shards(cfg.samples, cfg.workers)),
        uneven_gap_mean_of_means=_max_diff(results[0][1], single),
        uneven_gap_num_items=_max_diff(results[0][2], single),
        item_name=item_name,
    )
