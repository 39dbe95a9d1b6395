"""Strategy: one object for "how this run synchronises", whatever the way.

``gradsync train --strategy ddp|zero1|zero2|zero3 --precision fp32|bf16`` maps its
flags one-to-one onto :func:`build_strategy`, which returns a :class:`Strategy`.
The training loop, checkpoints and reports talk to that object only, so none of
them probes types: the model (``backward(loss, num_items=n)`` and ``no_sync()``
with DataParallel's exact semantics), the optimizer (a ``torch.optim.Optimizer``,
so LR schedulers work), the global gradient norm and clipping, the memory report,
what a checkpoint saves and how, whether replicas are identical (so a drift check
means something), and the bucket plan.

Extension points, for ways of synchronising still to come (local-update methods
such as DiLoCo, arXiv 2311.08105, section 2: H inner optimizer steps with no
gradient communication, then an outer step on all-reduced parameter deltas;
compressed reductions): a subclass gives a ``model`` whose ``backward`` does its
own (or no) communication, does its outer step in :meth:`Strategy.after_step`,
keeps what it needs across restarts in :meth:`extra_state` /
:meth:`load_extra_state` (saved in ``checkpoint.pt``), and says
``replicated = False`` while replicas may differ. :func:`register_strategy` adds
it to the registry the CLI's ``--strategy`` choices are derived from; the loop
does not change.

Stage 3 needs units to shard: by default the class of the elements of the largest
``ModuleList``/``Sequential`` of same-typed modules (a transformer's blocks), as
the ZeRO paper's per-layer gathering assumes (arXiv 1910.02054, section 5.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ...errors import UsageError
from ..compress.base import ring_bytes
from ..replicated.data_parallel import DataParallel
from ..replicated.memory_report import MemoryReport, report_data_parallel
from ..replicated.mixed_optimizer import MixedPrecisionOptimizer
from ..replicated.precision import parse_precision
from ..sharded.clip import clip_grad_norm_ as _clip
from ..sharded.fsdp.wrapper import FullyShardedDataParallel
from ..sharded.zero import ZeroOptimizer
from .options import SyncOptions

PRECISIONS = ("fp32", "bf16")


class Strategy:
    """A wrapped model and its optimizer, plus everything a loop asks of them.

    Attributes:
        name: the registry name (``ddp``, ``zero2``, ...).
        precision: ``fp32`` or ``bf16``.
        model: the wrapped model: ``model(x)``, ``model.backward(loss, num_items=n)``,
            ``model.no_sync()``, ``model.module`` (the unwrapped module).
        optimizer: steps the parameters this rank updates.
        replicated: every rank holds identical full parameters after a step (so a
            cross-rank drift check is meaningful and rank 0's copy is the model).
        not_replicated_because: when not, why (the run summary says it).

    ``model, optimizer = build_strategy(...)`` still works: a Strategy unpacks
    into that pair.
    """

    replicated = True
    not_replicated_because = "ranks hold different parameters"

    def __init__(self, name: str, precision: str, model, optimizer):
        self.name, self.precision = name, precision
        self.model, self.optimizer = model, optimizer

    def __iter__(self):
        return iter((self.model, self.optimizer))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.precision})"

    @property
    def module(self) -> nn.Module:
        return self.model.module

    # ----------------------------------------------------------------- training
    def _clip_target(self):
        return self.model

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (of the synchronised gradient), clipped to ``max_norm``.

        ``None``, 0 or ``inf`` only measure it (the norm is what a non-finite check
        reads). Sharded gradients sum their squared norms with one all-reduce, so
        every rank gets the same number.
        """
        limit = math.inf if not max_norm else float(max_norm)
        return _clip(self._clip_target(), limit)

    def after_step(self, num_items: int) -> None:
        """Called after every optimizer step (not after a skipped one), on every rank.

        ``num_items`` is the global item count of the step. Exact synchronisation
        has nothing to do here; a local-update method does its outer step here.
        """

    def finish(self) -> None:
        """Called once after the run's last step, before its final checkpoint, on every
        rank (a local-update method syncs the replicas one last time)."""

    def step_report(self) -> dict:
        """Figures of the step just taken for its metrics line, beyond what the loop
        measures: ``sent_bytes`` (this rank, on the wire), and for compressed
        gradients on probed steps ``grad_cosine`` / ``grad_rel_error`` against the
        exact gradient. Empty for exact synchronisation."""
        return {}

    # ----------------------------------------------------------------- reports
    def memory_report(self) -> MemoryReport:
        return report_data_parallel(self.model, self.optimizer)

    @property
    def bucket_plan(self) -> tuple:
        """The gradient buckets in use (after the first step's rebuild); () if none."""
        return tuple(self.model.bucket_plan)

    @property
    def bucket_cap_mb(self) -> float | None:
        return self.model.bucket_cap_bytes / 2**20

    @property
    def autotune_result(self):
        """What ``bucket_cap_mb="auto"`` measured and chose (None: a fixed cap)."""
        return self.model.autotune_result

    # ----------------------------------------------------------------- checkpoints
    @property
    def checkpoint_target(self) -> tuple | None:
        """``(target, optimizer)`` for engine.zero_checkpoint's sharded save/load, or
        None when the optimizer state is whole on every rank (saved by rank 0)."""
        return None

    def full_state_dict(self) -> dict:
        """The unwrapped module's full state (no ``module.`` prefix). May be a collective:
        every rank calls it."""
        return dict(self.model.module.state_dict())

    def load_full_state_dict(self, state: dict) -> None:
        self.model.module.load_state_dict(state)

    def optimizer_state_dict(self) -> dict | None:
        return None if self.checkpoint_target else self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def extra_state(self) -> dict:
        """Strategy state beyond model and optimizer (saved by rank 0: keep it identical
        on every rank). Empty for exact synchronisation."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        if state:
            raise UsageError(f"strategy {self.name} keeps no extra state, but the checkpoint "
                             f"holds {sorted(state)}")


class DataParallelStrategy(Strategy):
    """``ddp``: replicate everything (bf16: fp32 master copy, MixedPrecisionOptimizer)."""

    def step_report(self) -> dict:
        """Bytes on the wire per synchronised step: the bandwidth-optimal 2 (N-1)/N of every
        bucket (a ring all-reduce's, or a two-level one's across the slowest link)."""
        n = self.model.world_size
        return {"sent_bytes": sum(ring_bytes(b.spec.nbytes, n) for b in self.model.buckets)}

    def memory_report(self) -> MemoryReport:
        if isinstance(self.optimizer, MixedPrecisionOptimizer):
            return self.optimizer.memory_report()
        return report_data_parallel(self.model, self.optimizer)


class ZeroStrategy(Strategy):
    """``zero1``/``zero2``: optimizer state (and stage 2 gradients) sharded, parameters whole."""

    def _clip_target(self):
        return self.optimizer  # sharded gradients live with the shard owners

    def memory_report(self) -> MemoryReport:
        return self.optimizer.memory_report()

    @property
    def checkpoint_target(self) -> tuple:
        return self.optimizer, None


class FullyShardedStrategy(Strategy):
    """``zero3``: parameters sharded too; ranks hold different pieces between steps."""

    replicated = False
    not_replicated_because = "parameters sharded"

    def memory_report(self) -> MemoryReport:
        return self.model.memory_report(self.optimizer)

    bucket_plan = ()  # gradients are reduced per wrapped unit, not in buckets
    bucket_cap_mb = None
    autotune_result = None

    @property
    def checkpoint_target(self) -> tuple:
        return self.model, self.optimizer

    def full_state_dict(self) -> dict:
        return self.model.full_state_dict()  # a collective: every rank calls it

    def load_full_state_dict(self, state: dict) -> None:
        raise UsageError("a zero3 model is restored from its sharded checkpoint")


def default_wrap(module: nn.Module) -> set[type] | None:
    """The block class of the largest container of same-typed modules, if any."""
    best: tuple[int, type] | None = None
    for m in module.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kinds = {type(c) for c in m.children()}
            n = len(m)
            if n >= 2 and len(kinds) == 1 and (best is None or n > best[0]):
                best = (n, next(iter(kinds)))
    return {best[1]} if best else None


def _ddp(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
         find_unused_parameters=False, **opt_kwargs):
    sync = sync or SyncOptions()
    sync.check_precision(precision)
    if sync.method != "exact":
        from .builders import build_local
        bucket_cap = 25.0 if bucket_cap_mb == "auto" else bucket_cap_mb
        return build_local(module, precision, optimizer_class, group, sync, bucket_cap,
                           **opt_kwargs)
    mp = parse_precision(precision)
    reduction = None
    if sync.compress != "none":
        from .builders import compressed_reduction
        reduction = compressed_reduction(sync, mp)
    model = DataParallel(module, group=group, bucket_cap_mb=bucket_cap_mb,
                         collectives=sync.collectives, reduction=reduction,
                         find_unused_parameters=find_unused_parameters)
    if mp is not None:
        opt = MixedPrecisionOptimizer(model, optimizer_class, mp, **opt_kwargs)
    else:
        opt = optimizer_class(model.parameters(), **opt_kwargs)
    if reduction is not None:
        from .inexact import CompressedStrategy
        return CompressedStrategy("ddp", precision, model, opt, reduction)
    return DataParallelStrategy("ddp", precision, model, opt)


def _exact_only(name: str, sync) -> SyncOptions:
    sync = sync or SyncOptions()
    inexact = [f"--sync {sync.method}"] * (sync.method != "exact") + \
        [f"--compress {sync.compress}"] * (sync.compress != "none")
    if inexact:
        needs = "need" if len(inexact) > 1 else "needs"
        raise UsageError(f"--strategy {name} synchronises exactly: {' and '.join(inexact)} "
                         f"{needs} --strategy ddp")
    return sync


def _zero(stage: int):
    def build(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
              find_unused_parameters=False, **opt_kwargs):
        sync = _exact_only(f"zero{stage}", sync)
        model = DataParallel(module, group=group, bucket_cap_mb=bucket_cap_mb,
                             collectives=sync.collectives,
                             find_unused_parameters=find_unused_parameters)
        opt = ZeroOptimizer(model, optimizer_class, stage=stage,
                            mixed_precision=parse_precision(precision), **opt_kwargs)
        return ZeroStrategy(f"zero{stage}", precision, model, opt)
    return build


def _fsdp(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
          find_unused_parameters=False, **opt_kwargs):
    sync = _exact_only("zero3", sync)
    if sync.collectives not in ("native", "hierarchical"):
        raise UsageError(f"--strategy zero3 takes --collectives native or hierarchical "
                         f"(hybrid sharding), not {sync.collectives}")
    model = FullyShardedDataParallel(module, wrap=wrap or default_wrap(module),
                                     mixed_precision=parse_precision(precision), group=group,
                                     hybrid=sync.collectives == "hierarchical",
                                     find_unused_parameters=find_unused_parameters)
    return FullyShardedStrategy("zero3", precision, model,
                                optimizer_class(model.parameters(), **opt_kwargs))


StrategyBuilder = Callable[..., Strategy]
STRATEGIES: dict[str, StrategyBuilder] = {"ddp": _ddp, "zero1": _zero(1), "zero2": _zero(2),
                                          "zero3": _fsdp}
"""name -> builder(module, precision, optimizer_class, bucket_cap_mb, wrap, group, **opt_kwargs)."""

FIXED_BUCKETS: set[str] = {"zero1", "zero2", "zero3"}
"""Strategies whose shards are cut along a fixed bucket layout (no ``bucket_cap_mb='auto'``)."""


def register_strategy(name: str, builder: StrategyBuilder, fixed_buckets: bool = False) -> None:
    """Add a way of synchronising under ``name`` (then ``--strategy name`` accepts it)."""
    if not name or not isinstance(name, str):
        raise UsageError(f"a strategy needs a name, got {name!r}")
    STRATEGIES[name] = builder
    if fixed_buckets:
        FIXED_BUCKETS.add(name)


def build_strategy(module: nn.Module, strategy: str, precision: str, optimizer_class,
                   bucket_cap_mb: float | str = 25.0, wrap=None, group=None,
                   bucket_mb: float | str | None = None, sync: SyncOptions | None = None,
                   find_unused_parameters: bool = False, **opt_kwargs) -> Strategy:
    """Wrap ``module`` and build its optimizer; returns a :class:`Strategy`.

    strategy: a name in :data:`STRATEGIES` (``ddp`` | ``zero1`` | ``zero2`` | ``zero3``);
    precision: ``fp32`` | ``bf16``. ``bucket_cap_mb`` is the gradient bucket cap
    (DDP, ZeRO-1/2; ``bucket_mb`` is an older spelling of it); ``wrap`` the stage-3
    units; ``sync`` how gradients travel (:class:`SyncOptions`: exact by default;
    compression, local updates, hierarchical collectives); ``find_unused_parameters``
    as DataParallel's (passed to a builder only when set, so a registered builder
    without it keeps working); ``opt_kwargs`` go to ``optimizer_class``.
    """
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    parse_precision(precision)  # a bad precision is named before anything is built
    if bucket_mb is not None:
        bucket_cap_mb = bucket_mb
    if sync is not None:
        opt_kwargs["sync"] = sync
    if find_unused_parameters:
        opt_kwargs["find_unused_parameters"] = True
    return STRATEGIES[strategy](module, precision, optimizer_class, bucket_cap_mb, wrap,
                                group, **opt_kwargs)


def memory_report(model, optimizer=None) -> MemoryReport:
    """This rank's memory report: of a :class:`Strategy`, or of a (model, optimizer) pair."""
    if isinstance(model, Strategy):
        return model.memory_report()
    if isinstance(optimizer, (ZeroOptimizer, MixedPrecisionOptimizer)):
        return optimizer.memory_report()
    if isinstance(model, FullyShardedDataParallel):
        return model.memory_report(optimizer)
    if isinstance(model, DataParallel) and isinstance(optimizer, torch.optim.Optimizer):
        return report_data_parallel(model, optimizer)
    raise UsageError(f"no memory report for {type(model).__name__}/{type(optimizer).__name__}")
