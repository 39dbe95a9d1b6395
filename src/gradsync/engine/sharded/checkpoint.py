"""Sharded checkpoints for ZeroOptimizer and FullyShardedDataParallel, re-sharded on load.

Each rank writes only what it owns (its master slices and the optimizer state for
them), so saving costs no communication beyond two tiny barriers and never needs
the whole model on one rank (ZeRO, arXiv 1910.02054, keeps it that way). Records
are keyed by parameter *name*, with the element range each rank held, so loading
on a different number of workers (2 -> 3 -> 1) rebuilds every parameter from the
pieces and cuts the new shards: resuming continues the same trajectory.

Nothing is lost when something goes wrong:

* a save writes into ``<dir>.tmp-<token>/`` (each file written, fsynced, renamed),
  rank 0 writes ``manifest.json`` last (world size, stage, every tensor's name and
  shape, size and sha256 of every shard file, and the caller's identity: a training
  run's id, step and configuration digest), then swaps the directory in. A save
  interrupted at any point leaves the previous ``<dir>`` as it was.
* loading checks the manifest against the model (an error names the first
  mismatching tensor) and every file's size and checksum (an error names the file)
  before touching any state, so a failed load leaves the model unchanged and any
  other (e.g. the previous) checkpoint directory still loads.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path

import torch

from ...atomic import write_bytes
from ...dist import comm_device
from ...errors import UsageError
from ...safeload import load as safe_load
from ..transport import comm, host
from .fsdp.units import first_names
from .fsdp.wrapper import FullyShardedDataParallel
from .zero import ZeroOptimizer

FORMAT = 2  # 2: per-parameter-piece optimizer state, flattened per element


class CheckpointError(UsageError):
    """A checkpoint that does not match the model, or a damaged file."""


def _buffers(target, optimizer):
    """(names, shapes, layout, master, optimizer) of every flat sharded buffer."""
    if isinstance(target, ZeroOptimizer):
        names = target.model.trainable_names
        return "zero", target.stage, [
            ([names[i] for i in s.bucket.spec.params], [tuple(p.shape) for p in s.bucket.params],
             s.layout, s.master, target.optimizer, s.view) for s in target.shards]
    if isinstance(target, FullyShardedDataParallel):
        if optimizer is None:
            raise UsageError("checkpointing a FullyShardedDataParallel needs its optimizer")
        return "fsdp", 3, [(first_names(target.module, u), [tuple(s) for s in u.shapes],
                             u.layout, u.shard, optimizer, u.view) for u in target.units]
    raise UsageError(f"sharded checkpoints take a ZeroOptimizer or a FullyShardedDataParallel, "
                     f"got {type(target).__name__}")


def _extra_state(target, kind) -> dict:
    """What is not sharded: buffers (and, for FSDP, frozen parameters)."""
    if kind == "fsdp":
        return target.module.state_dict()
    return {n: b.detach().clone() for n, b in target.model.module.named_buffers()}


def _barrier(group, device) -> None:
    """Every rank's shard is on disk before rank 0 reads them (a host barrier: an
    all-reduce, as this was, returns on NCCL before the peers have written)."""
    comm.barrier(group, tag="ckpt_barrier")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(path, target, optimizer=None, _fail_before_manifest: bool = False,
                 identity: dict | None = None) -> Path:
    """Save this rank's shard of ``target`` into checkpoint directory ``path`` (all ranks call).

    ``target``: a ZeroOptimizer, or a FullyShardedDataParallel with its ``optimizer``.
    ``identity``: what ties these shards to the rest of a checkpoint (a training run's
    id, step and configuration digest), kept in the manifest for :func:`load_sharded`'s
    ``expect``.
    """
    kind, stage, bufs = _buffers(target, optimizer)
    group = target.group
    world, rank = target.world, target.rank
    lead = rank == 0 and getattr(target, "writes_shards", True)  # HSDP: host 0's rank 0
    device = comm_device(group)
    final = Path(path)
    token = torch.tensor([time.time_ns() % 2**52], dtype=torch.float64, device=device)
    comm.broadcast(token, 0, group, tag="ckpt_token")
    stamp = int(host.read(token)[0])
    tmp = final.with_name(f"{final.name}.tmp-{stamp}")
    if lead:
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier(group, device)
    records = []
    for names, shapes, layout, master, opt, view in bufs:
        n = layout.real_numel(rank)
        start = layout.shard_range(rank)[0]
        state, kinds = view.flat_state(opt)  # per element: each piece's own state
        records.append({"names": names, "shapes": shapes, "start": start, "n": n,
                        "master": master.detach()[:n].clone(), "state": state,
                        "kinds": kinds})
    opt0 = bufs[0][4] if bufs else optimizer
    payload = {"records": records,
               "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                for g in opt0.param_groups] if opt0 is not None else [],
               "extra": _extra_state(target, kind) if lead else None}
    buf = io.BytesIO()
    torch.save(payload, buf)
    if getattr(target, "writes_shards", True):  # HSDP: one host's copy of every shard
        write_bytes(tmp / f"shard-{rank:05d}-of-{world:05d}.pt", buf.getvalue(), "a shard file")
    _barrier(group, device)
    if _fail_before_manifest:
        raise RuntimeError("simulated interruption before the manifest was written")
    if lead:
        files = {}
        for r in range(world):
            f = tmp / f"shard-{r:05d}-of-{world:05d}.pt"
            data = f.read_bytes()
            files[f.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {"format": FORMAT, "kind": kind, "stage": stage, "world_size": world,
                    "optimizer": type(opt0).__name__ if opt0 is not None else None,
                    "tensors": [[n, list(s)] for names, shapes, *_ in bufs
                                for n, s in zip(names, shapes)],
                    "files": files, "identity": identity}
        write_bytes(tmp / "manifest.json", json.dumps(manifest, indent=1).encode(),
                    "the shard manifest")
        _fsync_dir(tmp)
        old = final.with_name(f"{final.name}.old-{stamp}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group, device)
    return final


def _read_verified(path: Path, expect: dict | None = None) -> tuple[dict, list[dict]]:
    mpath = path / "manifest.json"
    if not mpath.exists():
        hint = [p.name for p in path.parent.glob(f"{path.name}.*")]
        raise CheckpointError(f"{mpath}: no manifest (not a checkpoint, or its save did not "
                              f"finish{'; found ' + ', '.join(hint) if hint else ''})")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: checkpoint format {manifest.get('format')}, this "
                              f"gradsync reads format {FORMAT}")
    if expect is not None and manifest.get("identity") != expect:
        raise CheckpointError(f"{mpath}: shards of another checkpoint (saved as "
                              f"{manifest.get('identity')}, expected {expect})")
    payloads = []
    for name, meta in manifest["files"].items():
        f = path / name
        try:
            data = f.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read shard file ({e})") from None
        if len(data) != meta["bytes"]:
            raise CheckpointError(f"{f}: truncated or wrong size ({len(data)} bytes, manifest "
                                  f"says {meta['bytes']})")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch (file corrupted)")
        payloads.append(safe_load(io.BytesIO(data), f"shard file {f}"))  # data, never code
    return manifest, payloads


def load_sharded(path, target, optimizer=None, expect: dict | None = None) -> dict:
    """Load checkpoint directory ``path`` into ``target`` on any number of workers.

    Everything is verified before anything is modified (``expect``: the identity the
    manifest must carry, see :func:`save_sharded`). Returns the manifest.
    """
    kind, _stage, bufs = _buffers(target, optimizer)
    path = Path(path)
    manifest, payloads = _read_verified(path, expect)
    saved = {n: tuple(s) for n, s in manifest["tensors"]}
    module = target.model.module if kind == "zero" else target.module
    keys = target.original_keys if kind == "fsdp" else module.state_dict()
    order = {k: i for i, k in enumerate(keys)}
    mine = sorted(((n, s) for names, shapes, *_ in bufs for n, s in zip(names, shapes)),
                  key=lambda ns: order.get(ns[0].split(" = ")[0], len(order)))
    for n, s in mine:  # in the model's registration order: the first mismatch is named
        if n not in saved:
            raise CheckpointError(f"{path}: tensor {n!r} of this model is not in the "
                                  "checkpoint (a different model?)")
        if saved[n] != tuple(s):
            raise CheckpointError(f"{path}: tensor {n!r} has shape {list(saved[n])} in the "
                                  f"checkpoint but {list(s)} in this model")
    ours = {n for names, *_ in bufs for n in names}
    extra = [n for n in saved if n not in ours]
    if extra:
        raise CheckpointError(f"{path}: checkpoint tensor {extra[0]!r} is not in this model")
    opt0 = bufs[0][4] if bufs else optimizer
    if manifest.get("optimizer") not in (None, type(opt0).__name__):
        raise CheckpointError(f"{path}: saved with optimizer {manifest['optimizer']}, this run "
                              f"uses {type(opt0).__name__}")
    # rebuild every parameter (and per-element state) by name from all ranks' pieces
    full: dict[str, dict[str, torch.Tensor]] = {"master": {}}
    kinds: dict = {}
    for pl in payloads:
        for rec in pl["records"]:
            numels = [int(torch.Size(s).numel()) for s in rec["shapes"]]
            pieces = {"master": rec["master"], **rec["state"]}
            kinds.update(rec["kinds"])
            off = 0
            for name, numel in zip(rec["names"], numels):
                lo, hi = max(rec["start"], off), min(rec["start"] + rec["n"], off + numel)
                if lo < hi:
                    for key, t in pieces.items():
                        dst = full.setdefault(key, {}).setdefault(
                            name, torch.zeros(numel, dtype=t.dtype))
                        dst[lo - off:hi - off] = t[lo - rec["start"]:hi - rec["start"]]
                off += numel
    with torch.no_grad():
        for names, _shapes, layout, master, opt, view in bufs:
            start, end = layout.shard_range(target.rank)
            new = {}
            for key, per_name in full.items():
                dtype = master.dtype if key == "master" else next(iter(per_name.values())).dtype
                flat = torch.zeros(layout.padded, dtype=dtype)
                flat[:layout.numel] = torch.cat(  # a parameter nobody had state for: zeros
                    [per_name.get(n, torch.zeros(layout.numels[j], dtype=dtype))
                     for j, n in enumerate(names)]).to(dtype)
                new[key] = flat[start:end].clone()
            master.copy_(new.pop("master"))
            view.load_flat_state(opt, new, kinds)
        for g, saved_g in zip(opt0.param_groups, payloads[0]["param_groups"]):
            g.update(saved_g)
    ex = next((pl["extra"] for pl in payloads if pl.get("extra") is not None), None)
    if ex:
        module.load_state_dict(ex, strict=False)
    if kind == "zero":
        target.gather_params()
    return manifest
