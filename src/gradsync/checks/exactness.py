"""Does K-worker training reproduce one process on the whole batch? Measured, not assumed.

The worked example, run on real processes: a two-layer tanh regressor,
N=4096, d=16, H=32, K=8 workers, 200 full-batch SGD steps, lr 0.02, float64.
Expected: drift across replicas exactly 0, gap to the single process at machine
epsilon, final loss 0.179049 for both. A second run gives replica 0 half the data
and splits the rest among the other K-1 (three quarters when K=2; uneven shards):
the average of per-rank means (plain ``loss.backward()``) is then off, ``num_items``
weighting is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..data.regression import make_regression
from ..engine.replicated.data_parallel import DataParallel
from ..models.mlp import TanhMLP


@dataclass(frozen=True)
class ExactnessConfig:
    n: int = 4096
    d: int = 16
    hidden: int = 32
    workers: int = 8
    steps: int = 200
    lr: float = 0.02
    tolerance: float = 1e-12

    def __post_init__(self):
        from ..errors import UsageError

        for name in ("n", "d", "hidden", "workers", "steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.workers > self.n:
            raise UsageError(f"{self.workers} workers but only {self.n} samples")
        if not self.lr > 0 or not self.tolerance > 0:
            raise UsageError("--lr and --tolerance must be > 0")


@dataclass(frozen=True)
class ExactnessResult:
    config: ExactnessConfig
    max_drift: float
    max_gap: float
    single_loss: float
    replica_loss: float
    uneven_shard_sizes: tuple[int, ...]
    uneven_gap_mean_of_means: float
    uneven_gap_num_items: float

    @property
    def passed(self) -> bool:
        return (self.max_drift == 0.0 and self.max_gap <= self.config.tolerance
                and self.uneven_gap_num_items <= self.config.tolerance)


def even_shards(n: int, k: int) -> list[np.ndarray]:
    return np.array_split(np.arange(n), k)


def uneven_shards(n: int, k: int) -> list[np.ndarray]:
    """Replica 0 gets half the data, the others split the rest (uneven shards); with
    two replicas, three quarters (half would be even)."""
    if k == 1:
        return [np.arange(n)]
    first = n * 3 // 4 if k == 2 else n // 2
    return [np.arange(first)] + np.array_split(np.arange(first, n), k - 1)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train_single(cfg: ExactnessConfig, steps: int | None = None):
    x, y = make_regression(cfg.n, cfg.d)
    model = TanhMLP.from_reference_init(cfg.d, cfg.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps if steps is None else steps):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        final = float(_loss(model, x, y))
    return [p.detach().clone() for p in model.parameters()], final


def train_replica(cfg: ExactnessConfig, shards, use_items: bool, steps: int | None = None):
    """One rank's side: its shard every step, through gradsync.DataParallel."""
    import torch.distributed as dist

    from ..dist import comm_device

    rank, dev = dist.get_rank(), comm_device()
    x, y = (t.to(dev) for t in make_regression(cfg.n, cfg.d))
    idx = torch.as_tensor(shards[rank], device=dev)
    dp = DataParallel(TanhMLP.from_reference_init(cfg.d, cfg.hidden).to(dev))
    opt = torch.optim.SGD(dp.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps if steps is None else steps):
        loss = _loss(dp, x[idx], y[idx])
        if use_items:
            dp.backward(loss, num_items=len(idx))
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        final = float(_loss(dp.module, x, y))
    return [p.detach().cpu() for p in dp.module.parameters()], final


def _replica_job(cfg: ExactnessConfig):
    even = train_replica(cfg, even_shards(cfg.n, cfg.workers), use_items=True)
    uneven = uneven_shards(cfg.n, cfg.workers)
    plain = train_replica(cfg, uneven, use_items=False)
    exact = train_replica(cfg, uneven, use_items=True)
    return even, plain, exact


def _max_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


def run_exactness(cfg: ExactnessConfig) -> ExactnessResult:
    """Spawn ``cfg.workers`` processes and compare them with one process."""
    from ..launch import spawn

    results = spawn(_replica_job, cfg.workers, cfg)
    single, single_loss = train_single(cfg)
    even = [r[0] for r in results]
    drift = max((_max_diff(even[0][0], e[0]) for e in even[1:]), default=0.0)
    return ExactnessResult(
        config=cfg,
        max_drift=drift,
        max_gap=_max_diff(even[0][0], single),
        single_loss=single_loss,
        replica_loss=even[0][1],
        uneven_shard_sizes=tuple(len(s) for s in uneven_shards(cfg.n, cfg.workers)),
        uneven_gap_mean_of_means=_max_diff(results[0][1][0], single),
        uneven_gap_num_items=_max_diff(results[0][2][0], single),
    )
