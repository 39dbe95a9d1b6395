"""`gradsync verify`: does K-worker training reproduce one process on the whole batch? Measured.

One check, on two workloads. The same global batch is trained three ways on K
processes -- even shards with ``num_items``, uneven shards with plain
``loss.backward()`` (the average of per-rank means, DDP's convention) and uneven
shards with ``num_items`` -- and once on one process over the whole batch, then the
parameters are compared: drift across replicas must be exactly 0, the gap to the one
process at machine epsilon (``tolerance``), and the uneven shards exact only with
``num_items``. The uneven split gives replica 0 half the data and the others the rest
(three quarters when K=2).

* :class:`Regression`, the worked example (``gradsync verify``): a two-layer tanh
  regressor, N=4096, d=16, H=32, K=8 workers, 200 full-batch SGD steps, lr 0.02,
  float64. Expected: final loss 0.179049 for both.
* :class:`Factories` (``gradsync verify --model/--data``): the user's own model and
  data, taken with the factories ``gradsync train`` takes and read with its
  conventions (``train/task/build.py``: token losses with padding, dict inputs,
  transformers' ``labels``, a TrainData's own ``loss_fn``/``items_fn``), on the first
  ``samples`` samples, 3 steps. The model and the floating inputs and targets are cast
  to float64, so a gap at 1e-12 is a wrong sum and not rounding (a model that cannot
  run in float64 is refused in one line), and both sides run in ``eval()`` mode:
  dropout would draw different masks on K processes than on one, and batch norm would
  normalise each rank's shard by its own statistics (a real difference, which
  SyncBatchNorm exists for, but not the one this check is about).

Plain SGD on both sides: the check is of the gradient, and an optimizer with state
would only carry the same gradients further. The single process runs first, in the
calling process, so a model or data that fails at all fails there, in one line,
before any worker starts; the workers run on the communication device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..data.regression import make_regression
from ..engine.transport import host
from ..errors import UsageError
from ..models.mlp import TanhMLP


def _at_least_one(**values) -> None:
    for name, value in values.items():
        if value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")


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


@dataclass
class Built:
    """A workload made ready in one process: its model and how a set of samples trains."""

    model: torch.nn.Module
    loss: Callable  # (model, sample indices, device) -> (mean loss, items)
    item_name: str


@dataclass(frozen=True)
class Regression:
    """The worked example: a tanh regressor on ``n`` synthetic samples of ``d`` features."""

    n: int = 4096
    d: int = 16
    hidden: int = 32

    @property
    def samples(self) -> int:
        return self.n

    def check(self, workers: int, steps: int) -> None:
        _at_least_one(n=self.n, d=self.d, hidden=self.hidden, workers=workers, steps=steps)
        if workers > self.n:
            raise UsageError(f"{workers} workers but only {self.n} samples")

    def build(self) -> Built:
        x, y = make_regression(self.n, self.d)

        def loss(model, idx, device):
            idx = torch.as_tensor(np.asarray(idx))
            return ((model(x[idx].to(device)) - y[idx].to(device)) ** 2).mean(), len(idx)

        return Built(TanhMLP.from_reference_init(self.d, self.hidden), loss, "samples")


@dataclass(frozen=True)
class Factories:
    """The user's ``--model``/``--data``, read as ``gradsync train`` reads them, in float64."""

    model: str
    data: str
    samples: int = 16
    seed: int = 0

    def check(self, workers: int, steps: int) -> None:
        for name, value in (("workers", workers), ("n", self.samples), ("steps", steps)):
            _at_least_one(**{name: value})
        if self.samples < 2 * workers:
            raise UsageError(f"--n {self.samples} is too few for {workers} workers: the "
                             f"uneven split needs at least {2 * workers} samples")

    def build(self) -> Built:
        from ..train.config.train_config import TrainConfig
        from ..train.task.build import build_task

        cfg = TrainConfig(model=self.model, data=self.data, seed=self.seed, out=".")
        task = build_task(cfg.resolved())
        if len(task.data.train) < self.samples:
            raise UsageError(f"--data {self.data} holds {len(task.data.train)} samples; --n "
                             f"{self.samples} needs that many")
        try:
            task.model.double()
        except Exception as e:  # noqa: BLE001 - any failure to cast is the same answer
            raise UsageError(f"--model {self.model} cannot be cast to float64 "
                             f"({type(e).__name__}: {e}); verify compares in float64") from None
        task.model.eval()

        def loss(model, idx, device):
            batch = _double(task.collate(task.data.train, [int(i) for i in idx]))
            x, y = host.batch_to(batch, device)
            return task.data.loss_fn(_forward(model, x), y), task.items(x, y)

        return Built(task.model, loss, task.data.item_name or "items")


@dataclass(frozen=True)
class Check:
    """One exactness check: ``workload`` trained ``steps`` SGD steps of ``lr`` on
    ``workers`` processes and on one."""

    workload: Regression | Factories
    workers: int = 8
    steps: int = 200
    lr: float = 0.02
    tolerance: float = 1e-12

    def __post_init__(self):
        self.workload.check(self.workers, self.steps)
        if not self.lr > 0 or not self.tolerance > 0:
            raise UsageError("--lr and --tolerance must be > 0")


@dataclass(frozen=True)
class ExactnessResult:
    check: Check
    max_drift: float
    max_gap: float
    single_loss: float
    replica_loss: float
    uneven_shard_sizes: tuple[int, ...]
    uneven_gap_mean_of_means: float
    uneven_gap_num_items: float
    item_name: str

    @property
    def passed(self) -> bool:
        return (self.max_drift == 0.0 and self.max_gap <= self.check.tolerance
                and self.uneven_gap_num_items <= self.check.tolerance)


def even_shards(n: int, k: int) -> list[np.ndarray]:
    return np.array_split(np.arange(n), k)


def uneven_shards(n: int, k: int) -> list[np.ndarray]:
    """Replica 0 gets half the data, the others split the rest (uneven shards); with
    two replicas, three quarters (half would be even)."""
    if k == 1:
        return [np.arange(n)]
    first = n * 3 // 4 if k == 2 else n // 2
    return [np.arange(first)] + np.array_split(np.arange(first, n), k - 1)


def _final_loss(built: Built, model, n: int, device) -> float:
    with torch.no_grad():
        return float(built.loss(model, range(n), device)[0])


def train_single(check: Check):
    """One process, the whole batch: (parameters, initial state, final loss, item name)."""
    built = check.workload.build()
    model, n = built.model, check.workload.samples
    start = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=check.lr)
    cpu = torch.device("cpu")
    for _ in range(check.steps):
        try:
            loss, _ = built.loss(model, range(n), cpu)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's model or data failed: one line
            w = check.workload
            raise UsageError(f"--model {w.model} on --data {w.data} failed in float64: "
                             f"{type(e).__name__}: {e}") from None
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    return params, start, _final_loss(built, model, n, cpu), built.item_name


def _replica_run(built: Built, dp, init: dict, shards, use_items: bool, check: Check):
    """One rank's side of one way: its shard every step, through gradsync.DataParallel."""
    import torch.distributed as dist

    dp.module.load_state_dict(init)
    opt = torch.optim.SGD(dp.parameters(), lr=check.lr)
    idx, device = shards[dist.get_rank()], next(dp.module.parameters()).device
    for _ in range(check.steps):
        loss, n = built.loss(dp, idx, device)
        if use_items:
            dp.backward(loss, num_items=n)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    final = _final_loss(built, dp.module, check.workload.samples, device)
    return [p.detach().to("cpu", copy=True) for p in dp.module.parameters()], final


def _replica_job(check: Check, init: dict):
    from ..dist import comm_device
    from ..engine.replicated.data_parallel import DataParallel

    built = check.workload.build()
    dp = DataParallel(built.model.to(comm_device()))
    n, k = check.workload.samples, check.workers
    uneven = uneven_shards(n, k)
    return (_replica_run(built, dp, init, even_shards(n, k), True, check),
            _replica_run(built, dp, init, uneven, False, check),
            _replica_run(built, dp, init, uneven, True, check))


def _max_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


def run_exactness(check: Check) -> ExactnessResult:
    """One process first (a broken model fails here), then ``check.workers`` processes."""
    from ..launch import spawn

    single, init, single_loss, item_name = train_single(check)
    results = spawn(_replica_job, check.workers, check, init)
    even = [r[0] for r in results]
    return ExactnessResult(
        check=check,
        max_drift=max((_max_diff(even[0][0], e[0]) for e in even[1:]), default=0.0),
        max_gap=_max_diff(even[0][0], single),
        single_loss=single_loss,
        replica_loss=even[0][1],
        uneven_shard_sizes=tuple(len(s) for s in uneven_shards(check.workload.samples,
                                                                check.workers)),
        uneven_gap_mean_of_means=_max_diff(results[0][1][0], single),
        uneven_gap_num_items=_max_diff(results[0][2][0], single),
        item_name=item_name,
    )
