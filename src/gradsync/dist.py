"""Process-group set-up from torchrun's environment, and rank/world helpers.

``init()`` is what a training script calls first, under torchrun or inside
:func:`gradsync.spawn`. It picks NCCL when CUDA is present and gloo otherwise,
binds the process to its local GPU, and gives every collective a timeout so a
lost peer becomes an error instead of a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import UsageError

BACKENDS = ("auto", "gloo", "nccl")
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_timeout_s() -> float:
    """Collective timeout: ``GRADSYNC_TIMEOUT_S`` or 300 s."""
    raw = os.environ.get("GRADSYNC_TIMEOUT_S", "300")
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"GRADSYNC_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise UsageError(f"GRADSYNC_TIMEOUT_S must be > 0, got {raw!r}")
    return value


def resolve_backend(backend: str | None) -> str:
    """'auto'/None -> nccl with CUDA, gloo without; checks an explicit choice."""
    backend = (backend or "auto").lower()
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("backend 'nccl' needs CUDA GPUs and none is available; use --backend gloo")
    return backend


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise UsageError(
            f"environment variable {name}={os.environ[name]!r} is not an integer"
        ) from None


def info() -> DistInfo:
    """Rank, world size, local rank, backend and device of this process."""
    if not dist.is_initialized():
        return DistInfo(0, 1, 0, "none", torch.device("cpu"))
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def init(backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment variables.

    Idempotent: returns the existing group's info when already initialised.
    """
    if dist.is_initialized():
        return info()
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing:
        raise UsageError(
            f"not launched by torchrun or gradsync: {', '.join(missing)} unset. Run under "
            "`torchrun --nproc-per-node N script.py`, `gradsync train`, or gradsync.spawn()"
        )
    backend = resolve_backend(backend)
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else default_timeout_s())
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return info()


def shutdown() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0
