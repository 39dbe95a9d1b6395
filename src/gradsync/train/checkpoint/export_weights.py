"""The trained weights of a checkpoint, whole: what ``gradsync export`` writes.

``checkpoint.pt`` holds the unwrapped model's full state for every strategy (ZeRO-3
gathers it at save), so with ``--precision fp32`` that state *is* the model. With
``--precision bf16`` the module computes in bf16 and the optimizer steps fp32
master weights, which is where the trained values are exactly: ``checkpoint.pt``'s
model state holds their bf16 rounding. So the masters are taken where the
checkpoint keeps them:

* ZeRO-1/2 and ZeRO-3: the sharded directory (``checkpoint-shards/step-N``), every
  rank's master slice, joined by parameter name -- the consolidation DeepSpeed's
  ``zero_to_fp32`` does -- on any number of files, whatever the world size was;
* DDP: the ``MixedPrecisionOptimizer``'s ``masters``, one per trainable parameter,
  in ``module.parameters()`` order (matched against the rebuilt model).

Shard files are read only after their SHA-256 matched (``train/checkpoint/unit.py`` for a
checkpoint of format 3, the manifest's own record here for older ones), and only as
data (:mod:`gradsync.safeload`: weights only, never code).
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import torch
from torch import nn

from ...errors import UnsafeFileError, UsageError
from ...safeload import load as safe_load
from .format import CheckpointCorrupt
from .unit import MANIFEST


def _shard_payloads(root: str) -> list[dict]:
    try:
        with open(os.path.join(root, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{root}: the shard manifest is unreadable ({e})") from None
    payloads = []
    for name, meta in manifest.get("files", {}).items():
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise CheckpointCorrupt(f"{path} cannot be read ({e.strerror or e})") from None
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise CheckpointCorrupt(f"{path} does not match its checksum in {MANIFEST}")
        try:
            payloads.append(safe_load(io.BytesIO(data), f"shard file {path}"))
        except UnsafeFileError:
            raise
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    return payloads


def shard_masters(root: str) -> dict[str, torch.Tensor]:
    """Every parameter's master weights, joined from all ranks' slices (name -> tensor).

    A name may list a tied parameter's aliases (``"a = b"``, as ZeRO-3 records it).
    """
    flat: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple] = {}
    for payload in _shard_payloads(root):
        for rec in payload["records"]:
            off = 0
            for name, shape in zip(rec["names"], rec["shapes"]):
                numel = int(torch.Size(shape).numel())
                shapes[name] = tuple(shape)
                lo, hi = max(rec["start"], off), min(rec["start"] + rec["n"], off + numel)
                if lo < hi:
                    dst = flat.setdefault(name, torch.zeros(numel, dtype=rec["master"].dtype))
                    dst[lo - off:hi - off] = rec["master"][lo - rec["start"]:hi - rec["start"]]
                off += numel
    return {name: flat[name].view(shapes[name]) for name in flat}


def ddp_masters(optimizer_state, module: nn.Module) -> dict[str, torch.Tensor]:
    """DDP with bf16: the optimizer's fp32 masters by parameter name (empty otherwise)."""
    masters = optimizer_state.get("masters") if isinstance(optimizer_state, dict) else None
    if not masters:
        return {}
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    if len(names) != len(masters):
        raise UsageError(f"the checkpoint holds {len(masters)} master weights, the model has "
                         f"{len(names)} trainable parameters: is --model the run's model?")
    return dict(zip(names, masters))


@torch.no_grad()
def load_trained(module: nn.Module, state: dict, run_dir: str, spec: str) -> str:
    """Load the checkpoint's trained weights into ``module``; say which weights they are."""
    try:
        module.load_state_dict(state["model"], strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[1:2]) or first[0]
        raise UsageError(f"the checkpoint's model does not fit --model {spec}: {detail}") \
            from None
    shards = state.get("optimizer_shards")
    if shards:
        masters, where = shard_masters(os.path.join(run_dir, shards)), f"{shards} (master weights)"
    else:
        masters, where = ddp_masters(state.get("optimizer"), module), "the optimizer's masters"
    if not masters:
        return "the checkpoint's model state"
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, value in masters.items():
        aliases = [a for a in name.split(" = ") if a in params]
        if not aliases:
            raise UsageError(f"the checkpoint's parameter {name!r} is not in --model {spec}")
        for alias in aliases:
            if tuple(params[alias].shape) != tuple(value.shape):
                raise UsageError(f"the checkpoint's parameter {alias!r} has shape "
                                 f"{list(value.shape)}, --model {spec} {list(params[alias].shape)}")
            params[alias].copy_(value)
    return where
