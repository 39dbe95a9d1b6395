"""How many bytes a checkpoint save writes, counted before any worker starts.

The free-space preflight (``guard.check_run_dir``) needs the real figure, and what
a save writes depends on the strategy, the sync method and the compressor, not
only on the model. The counts follow what each one saves (``state.save`` and the
strategies' ``extra_state``); P is the model's trainable parameters:

* ``checkpoint.pt``, always: the whole model as stored (bf16 with ``--precision
  bf16``, except stage 3, which gathers its originals), the RNG state, the
  scheduler, sampler and configuration, and every tensor's CRC-32;

  - ddp: the optimizer state (AdamW: two tensors like P and a step; SGD: a momentum
    buffer), on the fp32 masters it also saves with bf16;
  - ``--compress int8`` (error feedback): every rank's residuals, gathered by rank 0:
    the bucket's and the owner's share (1 + 1/K times P); ``powersgd:R``: the
    bucket's and the Q factors; bf16/fp16 keep none;
  - ``--sync diloco|streaming-diloco``: every rank's replica, global copy (fp32 or
    wider), outer momentum, inner optimizer state and compressor residuals, and
    for streaming the largest fragments whose reduction can be in flight;
* ``checkpoint-shards/step-N`` (zero1-3), per element of P: the master value, a
  "present" flag (float64), each optimizer state tensor, and a scalar state such
  as AdamW's step widened to float64; rank 0's file also holds the buffers.

Measured (``tests/train/test_preflight_size.py``): within 10% of the bytes on disk
for ddp, zero1-3, diloco, streaming, int8 and powersgd. A save keeps the previous
checkpoint until the new one is complete (a temporary file renamed over it, a new
shard directory beside the old one), so :func:`space_needed` asks for two of them
at the peak, less what the current checkpoint already occupies -- and for one more per
unit ``--keep-last``/``--keep-best`` keep (:func:`checkpoints_at_peak`).
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...engine.local.exchange import split_parameters
from ...factory import is_factory_spec, load_factory
from ...models import build_model
from ...rundir import CHECKPOINT, KEPT, SHARDS
from ..config.run_config import RunConfig

PER_TENSOR = 330
"""Bytes a tensor costs in a torch.save zip beyond its data: its zip entry (local and
central headers, 64-byte alignment), its pickled reference and name, its CRC-32 entry."""
FIXED = 6900
"""checkpoint.pt beyond its tensors and its configuration: the RNG state (5 KiB), the
scheduler and sampler, the zip's own records."""
RNG_STATE = 5056
"""Bytes of torch's CPU generator state (``torch.get_rng_state()``)."""
SHARD_FILE = 1450
"""One shard file beyond its tensors, and the manifest's line per tensor (below)."""
MANIFEST_PER_TENSOR, MANIFEST = 80, 500


@dataclass
class SaveSize:
    """What one save writes, in bytes: ``checkpoint.pt`` and the shard directory."""

    checkpoint: int
    shards: int = 0

    @property
    def total(self) -> int:
        return self.checkpoint + self.shards


def _model(cfg: RunConfig, model_fn: Callable | None):
    fn = model_fn or (load_factory(cfg.run.model) if is_factory_spec(cfg.run.model) else None)
    if fn is None:  # built-in: small, and building for real skips meta's first-use cost (1 s)
        return build_model("gpt", seq_len=cfg.run.seq_len) if cfg.run.model == "gpt" \
            else build_model(cfg.run.model)
    with torch.device("meta"):
        return fn()


def _bf16(t) -> int:
    return 2 if t.is_floating_point() else t.element_size()


def _fp32(t) -> int:
    return 4


def _wide(t) -> int:  # DiLoCo's global copy: fp32 or wider
    return max(4, t.element_size())


def _own(t) -> int:
    return t.element_size()


def _nbytes(tensors, itemsize=None) -> int:
    return sum(t.numel() * (itemsize(t) if itemsize else t.element_size()) for t in tensors)


def _optimizer_state(params, itemsize, optimizer: str) -> tuple[int, int]:
    """(bytes, tensors) of a torch optimizer's state over ``params``."""
    if optimizer == "adamw":  # exp_avg, exp_avg_sq, and the step as a float32 scalar
        return 2 * _nbytes(params, itemsize) + 4 * len(params), 3 * len(params)
    return _nbytes(params, itemsize), len(params)  # SGD's momentum buffer


def _residuals(params, compress: str, world: int, rsize) -> tuple[int, int]:
    """(bytes, tensors) of one rank's compressor state (error feedback)."""
    kind = compress.split(":")[0]
    if kind == "int8":  # the bucket's residual and the owner's share of it
        return int(_nbytes(params, rsize) * (1 + 1 / world)), 2
    if kind == "powersgd":  # the bucket's residual and the Q factors (columns x rank)
        rank = int(compress.split(":")[1]) if ":" in compress else 1
        q = sum(p.numel() // p.shape[0] * rank * rsize(p) for p in params if p.dim() >= 2)
        return _nbytes(params, rsize) + q, 2
    return 0, 0  # bf16/fp16: no error feedback by default


def _in_flight(cfg: RunConfig, model) -> int:
    """Streaming DiLoCo: the largest fragments whose reduction a save can find in flight."""
    if cfg.sync.method != "streaming-diloco" or cfg.sync.delay == 0:
        return 0
    sizes = sorted((sum(p.numel() * _wide(p) for _, p in frag)
                    for frag in split_parameters(model, cfg.sync.fragments)), reverse=True)
    gap = max(1, cfg.sync.every // cfg.sync.fragments)  # steps between two fragments' sends
    return sum(sizes[:min(cfg.sync.fragments, math.ceil(cfg.sync.delay / gap))])


def estimate_save(cfg: RunConfig, model_fn: Callable | None = None,
                  world: int | None = None) -> SaveSize | None:
    """What a save of this run writes (None: the model cannot be built to count it)."""
    try:
        model = _model(cfg, model_fn)
        params = list(model.parameters())
        buffers = list(model.buffers())
    except Exception:  # noqa: BLE001 - an estimate we cannot make is not an error
        return None
    world = world or cfg.run.workers
    trainable = [p for p in params if p.requires_grad]
    bf16 = cfg.sync.precision != "fp32"
    stored = _bf16 if bf16 and cfg.sync.strategy != "zero3" else None
    master = _fp32 if bf16 else None  # optimizer state lives on the fp32 masters
    nbytes = _nbytes(params, stored) + _nbytes(buffers)
    # + the RNG state; every other rank's too (rng_by_rank: each continues its own draws)
    nbytes += (world - 1) * RNG_STATE
    count = len(params) + len(buffers) + world
    shards = shard_tensors = 0
    optimizer = cfg.optim.optimizer_name
    if cfg.sync.strategy in ("zero1", "zero2", "zero3"):
        state, _ = _optimizer_state(trainable, master, optimizer)
        scalar = 8 * sum(p.numel() for p in trainable) if optimizer == "adamw" else 0
        present = 8 * sum(p.numel() for p in trainable)
        shards = _nbytes(trainable, master) + present + state - 4 * len(trainable) + scalar
        shards += _nbytes(buffers)
        cap = 25.0 if cfg.sync.bucket_cap_mb == "auto" else float(cfg.sync.bucket_cap_mb)
        buckets = max(1, math.ceil(_nbytes(trainable) / (cap * 2**20)))
        keys = 4 if optimizer == "adamw" else 2  # master, present + the state's
        shard_tensors = (1 + keys) * world * buckets + len(buffers)
    elif cfg.sync.method != "exact":
        inner = _optimizer_state(trainable, None, optimizer)
        anchors = _nbytes(trainable, _wide)
        outer = anchors if cfg.sync.outer_momentum > 0 else 0
        res = _residuals(trainable, cfg.sync.compress, world, _wide)
        per_rank = (_nbytes(params) + _nbytes(buffers) + anchors + outer + inner[0] + res[0]
                    + _in_flight(cfg, model))
        nbytes += world * per_rank
        count += world * (len(params) + len(buffers) + 2 * len(trainable) + inner[1] + res[1])
    else:
        state = _optimizer_state(trainable, master, optimizer)
        nbytes += state[0] + (_nbytes(trainable, master) if bf16 else 0)
        count += state[1] + (len(trainable) if bf16 else 0)
        res = _residuals(trainable, cfg.sync.compress, world, master or _own)
        nbytes, count = nbytes + world * res[0], count + world * res[1]
    fixed = FIXED + len(pickle.dumps(cfg.to_dict()))
    checkpoint = fixed + nbytes + PER_TENSOR * count
    if shards:
        names = len(trainable)
        shards += (world * SHARD_FILE + PER_TENSOR * shard_tensors + MANIFEST
                   + MANIFEST_PER_TENSOR * names)
    return SaveSize(int(checkpoint), int(shards))


def estimate_checkpoint_bytes(cfg: RunConfig, model_fn: Callable | None = None) -> int | None:
    """About how many bytes one checkpoint of this run takes on disk (None: unknown)."""
    size = estimate_save(cfg, model_fn)
    return None if size is None else size.total


def on_disk(out: str) -> int:
    """Bytes the run directory's checkpoints occupy (``checkpoint.pt``, every shard
    directory and the kept units: replaced, linked or removed by the saves to come); a
    file linked into a kept unit counted once."""
    total, seen = 0, set()
    ckpt = os.path.join(out, CHECKPOINT)
    paths = [ckpt] if os.path.isfile(ckpt) else []
    for where in (SHARDS, KEPT):
        for root, _dirs, files in os.walk(os.path.join(out, where)):
            paths += [os.path.join(root, f) for f in files]
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def checkpoints_at_peak(cfg: RunConfig) -> int:
    """How many checkpoints are on disk at once at the peak of a save: the previous and the
    new one; with ``--keep-last N`` / ``--keep-best`` each kept unit holds its own bytes
    (the newest kept is the previous checkpoint itself, linked), and the new save comes
    beside them before the oldest is pruned."""
    n = cfg.checkpoints.keep_last
    kept = n + (1 if cfg.checkpoints.best else 0)
    return kept + (1 if n else 2)


def space_needed(cfg: RunConfig, model_fn: Callable | None = None) -> int | None:
    """Free bytes the run directory needs: at the peak of a save the checkpoints kept, the
    previous one and the new one are all on disk (:func:`checkpoints_at_peak`), less what
    they already occupy."""
    size = estimate_checkpoint_bytes(cfg, model_fn)
    if size is None:
        return None
    return max(size, checkpoints_at_peak(cfg) * size - on_disk(cfg.run.out))
