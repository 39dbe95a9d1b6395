"""The one door for reading a device tensor's values on the host.

On a GPU every read of a value (``.item()``, ``.tolist()``, ``float(t)``,
``.cpu()``) waits for everything queued on the device before it: a host sync.
The engine reads on purpose, rarely (the step's item count and fingerprint once
per synchronised backward, a replica check at construction), and only here, so
the reads are counted (:data:`reads`) and a review finds them in one place.

The emulated accelerator of ``GRADSYNC_NCCL_RULES=meta`` (``nccl_rules.py``) has
shapes but no values: a read there returns zeros of the right shape and dtype, so
the engine's constructors and steps run end to end on ``meta`` and every device
mistake on the way is seen, while what the values would have decided is not.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

reads = 0
"""How many device reads this process made through :func:`read` (tests and reports)."""


def read(tensor: torch.Tensor, emulated: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor``'s values in host memory (a CPU tensor; the tensor itself on the CPU).

    ``emulated``: what stands in for the values on the emulated accelerator, where a
    collective moved none (default zeros), when zeros would not be valid input to what
    follows (a permutation, say).
    """
    global reads
    reads += 1
    if tensor.device.type == "meta":
        if emulated is not None:
            return emulated
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    return tensor.detach().cpu()


_staging: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def staging(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer the engine fills and copies to ``device`` without blocking:
    pinned (page-locked) when ``device`` is a GPU, so ``copy_(..., non_blocking=True)``
    is a true asynchronous copy; plain memory otherwise. Registered as host memory on
    purpose (the device census of the tests allows it)."""
    pinned = device.type == "cuda" and torch.cuda.is_available()
    buf = torch.zeros(numel, dtype=dtype, pin_memory=pinned)
    _staging[id(buf)] = buf
    return buf


def is_staging(tensor: torch.Tensor) -> bool:
    return _staging.get(id(tensor)) is tensor


def to_host(obj):
    """``obj`` with every tensor in it (nested dicts, lists, tuples) read to the host:
    what a checkpoint or an object collective pickles. A device tensor pickled as it
    is would be unpickled by every rank onto the device it came from (another rank's
    GPU)."""
    if isinstance(obj, torch.Tensor):
        return read(obj).clone() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


def to_device(obj, device: torch.device):
    """``obj`` with its tensors of one or more dimensions moved to ``device`` (a
    checkpoint loads on the host). 0-dim tensors stay: torch's optimizers keep
    counters such as Adam's ``step`` on the host unless capturable or fused."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if obj.dim() > 0 else obj
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def batch_to(obj, device: torch.device):
    """A batch (tensors inside tuples, lists and dicts) moved to ``device``.

    To a GPU the copy is asynchronous from page-locked memory: the host goes on to
    the next micro-batch while the copy runs (a plain ``.to`` waits for it). Unlike
    :func:`to_device` (checkpoint state), 0-dim tensors move too: a batch's scalars
    are inputs."""
    if isinstance(obj, torch.Tensor):
        if device.type == "cuda" and obj.device.type == "cpu":
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: batch_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(batch_to(v, device) for v in obj)
    return obj
