"""Every strategy and mode, built and stepped on a device that is not the host.

``tests/engine/test_device_discipline.py`` runs these jobs on the emulated
accelerator of ``GRADSYNC_NCCL_RULES=meta`` (``gradsync/nccl_rules.py``): the
communication device is ``meta``, so the model, every buffer the engine allocates
for it and every tensor a collective moves must be on ``meta``. A host tensor that
meets a device tensor is torch's device-mismatch error, a host tensor handed to a
collective is ``NcclRuleError``, and a value read outside the engine's one door
(``engine/transport/host.py``) is torch's "no data" error; after the steps,
:func:`census` walks everything the strategy holds and names any tensor left on
the host. Checkpoints come from the same job run on the CPU (real values), loaded
into the meta run as a resume on a GPU loads a file: host tensors in, device out.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

import gradsync as gs
from gradsync import dist as gdist
from gradsync.engine.sharded.checkpoint import load_sharded, save_sharded
from gradsync.engine.strategy.options import SyncOptions
from gradsync.engine.strategy.registry import build_strategy
from gradsync.engine.transport import host


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x))) + x


class Net(nn.Module):
    """Input layer, two wrapped blocks, a BatchNorm (a buffer that moves), a head."""

    def __init__(self, d: int = 12):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.bn(self.blocks(torch.tanh(self.inp(x)))))


# name -> (strategy, precision, SyncOptions fields, world)
MODES = {
    "ddp": ("ddp", "fp32", {}, 2),
    "ddp-bf16": ("ddp", "bf16", {}, 2),
    "zero1": ("zero1", "fp32", {}, 2),
    "zero2-bf16": ("zero2", "bf16", {}, 2),
    "zero3": ("zero3", "fp32", {}, 2),
    "zero3-bf16": ("zero3", "bf16", {}, 2),
    "ddp-fp16": ("ddp", "fp16", {}, 2),  # loss scaling: the flag, the fp32 sums, the scale
    "zero1-fp16": ("zero1", "fp16", {}, 2),
    "zero3-fp16": ("zero3", "fp16", {}, 2),
    "int8": ("ddp", "fp32", {"compress": "int8", "probe_every": 2}, 2),
    "powersgd": ("ddp", "fp32", {"compress": "powersgd:2"}, 2),
    "bf16-wire": ("ddp", "fp32", {"compress": "bf16"}, 2),
    "ring": ("ddp", "fp32", {"collectives": "ring"}, 2),
    "hierarchical": ("ddp", "fp32", {"collectives": "hierarchical"}, 4),
    "hierarchical-int8": ("ddp", "fp32", {"collectives": "hierarchical", "compress": "int8"}, 4),
    "zero2-hierarchical": ("zero2", "fp32", {"collectives": "hierarchical"}, 4),
    "zero3-hybrid": ("zero3", "fp32", {"collectives": "hierarchical"}, 4),
    "diloco": ("ddp", "fp32", {"method": "diloco", "every": 2}, 2),
    "diloco-int8": ("ddp", "fp32", {"method": "diloco", "every": 2, "compress": "int8"}, 2),
    "streaming": ("ddp", "fp32", {"method": "streaming-diloco", "every": 2, "fragments": 2}, 2),
}

STEPS = 3


def _hosts_of_two(world: int) -> None:
    """torchrun's description of 2 hosts of ``world // 2`` ranks, for this process."""
    if world == 4:
        rank = int(os.environ["RANK"])
        os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2",
                          GROUP_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))


def build(mode: str, device: torch.device):
    strategy, precision, sync, world = MODES[mode]
    _hosts_of_two(world)
    module = Net().to(device)
    return build_strategy(module, strategy, precision, torch.optim.AdamW,
                          bucket_cap_mb=0.0008, wrap={Block}, sync=SyncOptions(**sync),
                          lr=1e-2, weight_decay=0.1)


def step(strat, k: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(100 * k + gs.rank())
    n = 3 + gs.rank()  # uneven items
    x = torch.randn(n, 6, generator=g).to(device)
    y = torch.randn(n, 3, generator=g).to(device)
    loss = nn.functional.mse_loss(strat.model(x), y)
    strat.model.backward(loss, num_items=n)
    strat.clip_grad_norm_(1.0)
    strat.optimizer.step()
    strat.after_step(n * gs.world_size())
    strat.optimizer.zero_grad()


def save_job(mode: str, ckpt_dir: str) -> dict:
    """The mode on the CPU with real values: a few steps, then what a checkpoint holds."""
    dev = gdist.comm_device()
    strat = build(mode, dev)
    for k in range(STEPS):
        step(strat, k, dev)
    out = {"full": strat.full_state_dict(), "optimizer": strat.optimizer_state_dict(),
           "extra": strat.extra_state(), "sharded": None}
    if strat.checkpoint_target is not None:
        target, opt = strat.checkpoint_target
        save_sharded(os.path.join(ckpt_dir, mode), target, opt)
        out["sharded"] = os.path.join(ckpt_dir, mode)
    return out if gs.rank() == 0 else {}


def device_job(mode: str, saved: dict) -> dict:
    """The mode on the emulated accelerator: steps, a resume from the CPU's files,
    a step more; then every tensor the strategy holds that is not on the device."""
    dev = gdist.comm_device()
    assert dev.type == "meta", f"not on the emulated accelerator: {dev}"
    reads0 = host.reads
    strat = build(mode, dev)
    for k in range(STEPS):
        step(strat, k, dev)
    if saved["sharded"] is not None:  # as a resume does: the shards hold model and state
        load_sharded(saved["sharded"], *strat.checkpoint_target)
    else:
        strat.load_full_state_dict(saved["full"])
        strat.load_optimizer_state_dict(saved["optimizer"])
    strat.load_extra_state(saved["extra"])
    step(strat, STEPS, dev)
    return {"off_device": census(strat, dev), "host_reads": host.reads - reads0}


# ---------------------------------------------------------------------- the census
_SKIP_TYPES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def census(root, device: torch.device) -> list[str]:
    """Paths of every tensor reachable from ``root`` that is not on ``device``.

    Walks attributes (``__dict__`` and ``__slots__``), containers, modules (their
    parameters, gradients and buffers) and optimizer state. Allowed on the host:
    0-dim optimizer state such as Adam's ``step`` (torch keeps it there unless the
    optimizer is capturable or fused) and buffers the engine made as host staging on
    purpose (``host.staging``).
    """
    found: list[str] = []
    seen: set[int] = set()

    def visit(obj, path: str, depth: int) -> None:
        if depth > 14 or isinstance(obj, _SKIP_TYPES) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device != device and not host.is_staging(obj):
                if not (obj.dim() == 0 and ".state[" in path):
                    found.append(f"{path}: {obj.device} {tuple(obj.shape)}")
            if obj.grad is not None:
                visit(obj.grad, path + ".grad", depth + 1)
            return
        if isinstance(obj, torch.optim.Optimizer):
            for i, g in enumerate(obj.param_groups):
                for j, p in enumerate(g["params"]):
                    visit(p, f"{path}.param_groups[{i}][{j}]", depth + 1)
                    for key, v in obj.state.get(p, {}).items():
                        visit(v, f"{path}.state[{i},{j}][{key!r}]", depth + 1)
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                visit(v, f"{path}[{k!r}]", depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(obj)):
                visit(v, f"{path}[{i}]", depth + 1)
            return
        module = type(obj).__module__ or ""
        if not (module.startswith(("gradsync", "tests", "torch.nn", "torch.optim"))
                or dataclasses.is_dataclass(obj)):
            return
        attrs = dict(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(obj, slot):
                    attrs[slot] = getattr(obj, slot)
        for k, v in attrs.items():
            visit(v, f"{path}.{k}", depth + 1)

    visit(root, "strategy", 0)
    return found


def wrong_device_job() -> dict:
    """A host model handed to the emulated accelerator's group: refused in one line."""
    out = {}
    for what in ("ddp", "zero3", "diloco"):
        try:
            build_strategy(Net(), what if what != "diloco" else "ddp", "fp32",
                           torch.optim.SGD, wrap={Block},
                           sync=SyncOptions(method="diloco") if what == "diloco" else None,
                           lr=0.1)
            out[what] = None
        except gs.UsageError as e:
            out[what] = str(e)
    return out
