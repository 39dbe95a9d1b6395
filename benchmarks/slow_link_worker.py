"""One method of the slow-link benchmark: `gradsync train`'s worker, plus the anchor.

Run by ``benchmarks/slow_link.py`` under one torchrun agent per emulated host::

    torchrun ... benchmarks/slow_link_worker.py --strategy torch-ddp \
        --model slow_link_worker:mlp ...

It registers one more strategy, ``torch-ddp`` (torch's own
``DistributedDataParallel``, the anchor every method is judged against), then hands
the flags to ``python -m gradsync.train``, so every method -- the anchor included --
runs the same loop: the same sampler, global batch, learning-rate schedule,
clipping, held-out evaluation and metrics. Only how gradients travel differs.

torch DDP averages gradients over ranks; gradsync divides by the global item
count. The benchmark gives every rank the same number of items per step (and one
micro-batch per step), so both are the mean over the global batch.

``mlp`` is the built-in 8x1024 GELU MLP with He-normal initialisation: PyTorch's
default Linear init shrinks the signal through eight layers until the output is
nearly constant, and the teacher regression's held-out loss then does not move
within the benchmark's budget, leaving nothing to reach.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.engine.compress.base import ring_bytes
from gradsync.engine.replicated.memory_report import MemoryReport, optimizer_bytes
from gradsync.engine.strategy.base import Strategy
from gradsync.engine.strategy.registry import STRATEGIES, register_strategy
from gradsync.models import DeepMLP


def mlp() -> nn.Module:
    """DeepMLP (8 x Linear(1024, 1024) + GELU), He-normal weights, zero biases."""
    model = DeepMLP()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, (2.0 / m.in_features) ** 0.5, generator=g)
                m.bias.zero_()
    return model


class TorchDDPModel:
    """torch DDP behind the interface gradsync's loop calls (``backward``, ``no_sync``)."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float, group=None):
        self.module = module
        self.ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb,
                                           process_group=group)
        self.world_size = torch.distributed.get_world_size(group)
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.bucket_plan, self.buckets, self.autotune_result = (), (), None

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor, num_items=None) -> None:
        loss.backward()  # DDP's mean over ranks = the global mean with equal items per rank

    def no_sync(self):
        return self.ddp.no_sync()

    def parameters(self):
        return self.module.parameters()

    def train(self, mode: bool = True):
        self.ddp.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.ddp.training


class TorchDDPStrategy(Strategy):
    """``torch-ddp``: the anchor. Bytes per step counted as a ring all-reduce's; the
    gradient norm and clipping are the base class's (torch's own function on the
    parameters, whose gradients DDP has already averaged)."""

    def step_report(self) -> dict:
        nbytes = sum(p.numel() * p.element_size() for p in self.module.parameters()
                     if p.requires_grad)
        return {"sent_bytes": ring_bytes(nbytes, self.model.world_size)}

    def memory_report(self) -> MemoryReport:
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        grads = sum(p.numel() * p.element_size() for p in trainable)
        state = sum(optimizer_bytes(self.optimizer, p, p.numel())[0] for p in trainable)
        num = sum(p.numel() for p in trainable)
        return MemoryReport(0, self.model.world_size, num, params, grads, 0, state, 0, 0)

    @property
    def bucket_cap_mb(self) -> float:
        return self.model.bucket_cap_bytes / 2**20


def build_torch_ddp(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
                    **opt_kwargs) -> Strategy:
    if precision != "fp32" or (sync is not None and (sync.method != "exact"
                                                     or sync.compress != "none")):
        raise ValueError("torch-ddp is the fp32 exact anchor: no --precision, --sync or --compress")
    model = TorchDDPModel(module, float(bucket_cap_mb), group)
    return TorchDDPStrategy("torch-ddp", precision, model,
                            optimizer_class(module.parameters(), **opt_kwargs))


if "torch-ddp" not in STRATEGIES:
    register_strategy("torch-ddp", build_torch_ddp)

if __name__ == "__main__":
    from gradsync.train.__main__ import main

    sys.exit(main())
