"""The exact strategies: ``ddp``, ``zero1``, ``zero2`` and ``zero3``.

Each says what its model and optimizer hold (replicated or sharded), how the loop
clips (``ZeroStrategy`` through the shard owners) and checkpoints them (sharded
targets for ``sharded/checkpoint.py``), and which memory report applies.

Stage 3 needs units to shard: by default the class of the elements of the largest
``ModuleList``/``Sequential`` of same-typed modules (a transformer's blocks), as
the ZeRO paper's per-layer gathering assumes (arXiv 1910.02054, section 5.3).
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import UsageError
from ..compress.base import ring_bytes
from ..replicated.data_parallel import DataParallel
from ..replicated.memory_report import MemoryReport, report_data_parallel
from ..replicated.mixed_optimizer import MixedPrecisionOptimizer
from ..sharded.fsdp.wrapper import FullyShardedDataParallel
from ..sharded.zero import ZeroOptimizer
from .base import Strategy


class DataParallelStrategy(Strategy):
    """``ddp``: replicate everything (bf16/fp16: fp32 master copy, MixedPrecisionOptimizer)."""

    def _clip_target(self):
        opt = self.optimizer  # fp16: the masters step the fp32 sum, not the fp16 .grad
        if isinstance(opt, MixedPrecisionOptimizer) and opt.wide_grads:
            return opt
        return self.model

    def zero_grad(self) -> None:
        """The buckets zeroed in place and ``.grad`` None (DataParallel.zero_grad): the
        next backward re-points every ``.grad`` at its zeroed view and autograd
        accumulates into the bucket. The optimizer's own ``zero_grad(set_to_none=True)``
        alone dropped the views, and every gradient was then allocated afresh and copied
        into its bucket, each step."""
        self.model.zero_grad(set_to_none=True)
        if not isinstance(self.optimizer, MixedPrecisionOptimizer):  # its zero_grad is that
            self.optimizer.zero_grad(set_to_none=True)

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

    def shard_owner(self):
        return self.optimizer

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

    def shard_owner(self):
        return self.model

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
