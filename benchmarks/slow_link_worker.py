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

The benchmark's own model and data (``--model slow_link_worker:mlp`` etc.), each
drawn from torch's generator, which `gradsync train` seeds with ``--seed`` before
building them, so a seed is a different initialisation, data order and (for the MLP)
task:

* ``mlp``: eight Linear(1024, 1024) layers (32 MiB of float32 gradient, the
  communication-bound workload) with GELU between them but not after the last
  (the built-in DeepMLP ends in a GELU, which cannot output the negative half of
  a tanh target), He-normal initialisation (PyTorch's default shrinks the signal
  through the layers). The last layer starts at zero: from He-normal weights
  throughout, the first outputs are far off (held-out loss 2.2), and AdamW's first
  steps then shrink the network into predicting a constant it does not leave.
* ``lowrank_teacher``: regression on ``tanh(2 x U V)`` with a rank-16 teacher: the
  full-rank teacher of ``--data teacher`` is not learnable in the benchmark's budget
  (the held-out loss stays at what predicting zero gives, so every method "reaches"
  the target and training without communication looks as good as any); this one
  is learned, and how many samples a step sees matters.
* ``pysrc_wide``: the built-in GPT's corpus with a held-out set of every
  ``len // HELD_OUT_WINDOWS``-th window spread over the whole corpus (512 windows,
  65,536 tokens, 4x the built-in's 128 taken from its end): with ``--data-parts``
  each host trains on a different part of the corpus, and the held-out set must
  sample every part.

``LinkCounter`` (rank 0, after every step) appends the host's link counters to
``link_bytes.jsonl`` in the run directory: with two hosts, what host 0 sent and
received is everything that crossed the emulated link.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset, TensorDataset

from gradsync.engine.compress.base import ring_bytes
from gradsync.engine.replicated.memory_report import MemoryReport, optimizer_bytes
from gradsync.engine.strategy.base import Strategy
from gradsync.engine.strategy.registry import STRATEGIES, register_strategy
from gradsync.train.records.callbacks import Callback
from gradsync.train.task.build import TrainData

MLP_DEPTH, MLP_WIDTH = 4, 1024


def mlp() -> nn.Module:
    """4 x Linear(1024, 1024) with GELU between (not after the last), He-normal weights
    from torch's seeded generator, zero biases, a zero last layer."""
    layers: list[nn.Module] = []
    for i in range(MLP_DEPTH):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH)]
        layers += [nn.GELU()] if i < MLP_DEPTH - 1 else []
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, (2.0 / m.in_features) ** 0.5)
                m.bias.zero_()
        model[-1].weight.zero_()  # start from predicting 0 (see below)
    return model


TEACHER_RANK, TEACHER_TRAIN, TEACHER_HELD = 16, 4096, 512


def lowrank_teacher() -> TrainData:
    """x ~ N(0, I_1024), y = tanh(2 x U V): U (1024 x 16), V (16 x 1024), from torch's
    generator (seeded by --seed); 4096 training samples, 512 held out."""
    n, width = TEACHER_TRAIN + TEACHER_HELD, 1024
    u = torch.randn(width, TEACHER_RANK) / width**0.5
    v = torch.randn(TEACHER_RANK, width) / TEACHER_RANK**0.5
    x = torch.randn(n, width)
    data = TensorDataset(x, torch.tanh(2 * (x @ u) @ v))
    return TrainData(Subset(data, range(TEACHER_TRAIN)), Subset(data, range(TEACHER_TRAIN, n)))


HELD_OUT_WINDOWS, SEQ_LEN = 512, 128


def pysrc_wide() -> TrainData:
    """The stdlib corpus in windows of 128 tokens; every (n // 512)-th window held out."""
    from gradsync.train.task.builtins import DATASETS

    windows = DATASETS["pysrc"][1](SEQ_LEN, 0)
    stride = len(windows) // HELD_OUT_WINDOWS
    held = set(range(stride - 1, stride * HELD_OUT_WINDOWS, stride))
    train = [i for i in range(len(windows)) if i not in held]
    return TrainData(Subset(windows, train), Subset(windows, sorted(held)))


class LinkCounter(Callback):
    """After every step (rank 0): this host's link counters, appended to link_bytes.jsonl."""

    def __init__(self):
        self.iface = os.environ.get("GLOO_SOCKET_IFNAME")

    def on_step_end(self, info) -> None:
        if not self.iface:
            return
        stats = Path("/sys/class/net") / self.iface / "statistics"
        line = {"step": info.step, "tx": int((stats / "tx_bytes").read_text()),
                "rx": int((stats / "rx_bytes").read_text())}
        with open(Path(info.out) / "link_bytes.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


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

    sys.exit(main(callbacks=[LinkCounter()]))
