"""build_strategy: one call from a training loop to DDP, ZeRO-1/2 or ZeRO-3 (FSDP).

``gradsync train --strategy ddp|zero1|zero2|zero3 --precision fp32|bf16`` maps its
flags one-to-one onto :func:`build_strategy`. Whatever the strategy, the returned
model has ``backward(loss, num_items=n)`` and ``no_sync()`` with DataParallel's exact
semantics, and the optimizer is a ``torch.optim.Optimizer`` (LR schedulers work).
:func:`memory_report` gives the per-rank memory report for the run summary.

Stage 3 needs units to shard: by default the class of the elements of the largest
``ModuleList``/``Sequential`` of same-typed modules (a transformer's blocks), as
the ZeRO paper's per-layer gathering assumes (arXiv 1910.02054, section 5.3).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError
from .data_parallel import DataParallel
from .fsdp import FullyShardedDataParallel
from .memory import MemoryReport, report_data_parallel
from .mixed_dp import MixedPrecisionOptimizer
from .precision import parse_precision
from .zero import ZeroOptimizer

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


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


def build_strategy(module: nn.Module, strategy: str, precision: str, optimizer_class,
                   bucket_mb: float = 25.0, wrap=None, group=None, **opt_kwargs):
    """Wrap ``module`` and build its optimizer; returns ``(model, optimizer)``.

    strategy: ``ddp`` | ``zero1`` | ``zero2`` | ``zero3``; precision: ``fp32`` | ``bf16``.
    ``bucket_mb`` is the gradient bucket cap (DDP, ZeRO-1/2); ``wrap`` the stage-3 units.
    """
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    mp = parse_precision(precision)
    if strategy == "ddp":
        model = DataParallel(module, group=group, bucket_cap_mb=bucket_mb)
        if mp is not None:
            return model, MixedPrecisionOptimizer(model, optimizer_class, mp, **opt_kwargs)
        return model, optimizer_class(model.parameters(), **opt_kwargs)
    if strategy in ("zero1", "zero2"):
        model = DataParallel(module, group=group, bucket_cap_mb=bucket_mb)
        opt = ZeroOptimizer(model, optimizer_class, stage=int(strategy[-1]), mixed_precision=mp,
                            **opt_kwargs)
        return model, opt
    model = FullyShardedDataParallel(module, wrap=wrap or default_wrap(module),
                                     mixed_precision=mp, group=group)
    return model, optimizer_class(model.parameters(), **opt_kwargs)


def memory_report(model, optimizer) -> MemoryReport:
    """This rank's memory report for any pair returned by :func:`build_strategy`."""
    if isinstance(optimizer, (ZeroOptimizer, MixedPrecisionOptimizer)):
        return optimizer.memory_report()
    if isinstance(model, FullyShardedDataParallel):
        return model.memory_report(optimizer)
    if isinstance(model, DataParallel) and isinstance(optimizer, torch.optim.Optimizer):
        return report_data_parallel(model, optimizer)
    raise UsageError(f"no memory report for {type(model).__name__}/{type(optimizer).__name__}")
