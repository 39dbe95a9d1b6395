"""The strategy registry: names ``--strategy`` accepts, and :func:`build_strategy`.

Read, never copied: the CLI builds its ``--strategy`` choices from
:data:`STRATEGIES` when the parser is built, and ``TrainConfig`` checks a name
against it when the config is made, so a strategy registered with
:func:`register_strategy` at any time before then is accepted, whatever the order
of imports.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...errors import UsageError
from ..replicated.precision import parse_precision
from .base import Strategy
from .builders import build_ddp, build_fsdp, build_zero
from .options import SyncOptions

PRECISIONS = ("fp32", "bf16", "fp16")

StrategyBuilder = Callable[..., Strategy]
STRATEGIES: dict[str, StrategyBuilder] = {"ddp": build_ddp, "zero1": build_zero(1),
                                          "zero2": build_zero(2), "zero3": build_fsdp}
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
                   find_unused_parameters: bool = False, outer_sync=None,
                   **opt_kwargs) -> Strategy:
    """Wrap ``module`` and build its optimizer; returns a :class:`Strategy`.

    strategy: a name in :data:`STRATEGIES` (``ddp`` | ``zero1`` | ``zero2`` | ``zero3``);
    precision: ``fp32`` | ``bf16`` | ``fp16`` (with dynamic loss scaling). ``bucket_cap_mb``
    is the gradient bucket cap (DDP, ZeRO-1/2; ``bucket_mb`` is an older spelling of it);
    ``wrap`` the stage-3 units; ``sync`` how gradients travel (:class:`SyncOptions`: exact
    by default; compression, local updates, hierarchical collectives); ``find_unused_parameters``
    as DataParallel's (passed to a builder only when set, so a registered builder
    without it keeps working); ``outer_sync`` (local updates only, passed likewise): a
    factory ``(module, inner_optimizer, outer_optimizer, sync) -> DiLoCo`` that makes
    this process group one DiLoCo worker whose syncs the caller takes (replica groups,
    ``ft/local_groups.py``); ``param_groups``, when given, optimizer parameter groups
    written with the module's parameter names, which every built-in strategy resolves to
    what its optimizer steps (whole parameters, fp32 masters or this rank's shards,
    ``sync/param_groups.py``) and hands to ``optimizer_class`` as its first argument;
    ``opt_kwargs`` go to ``optimizer_class``.
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
    if outer_sync is not None:
        opt_kwargs["outer_sync"] = outer_sync
    return STRATEGIES[strategy](module, precision, optimizer_class, bucket_cap_mb, wrap,
                                group, **opt_kwargs)
