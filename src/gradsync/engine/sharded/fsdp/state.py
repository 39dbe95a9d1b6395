"""FSDP's consolidated state dict: out (gathered from every rank) and in (sliced locally).

Out: every unit's flat shards are gathered and split back into the module's own
parameters, under their original names (no ``module.`` prefix, tied weights under
each name), with the module's buffers -- the dict one process would save.

In: every rank holds the whole dict (``torch.load`` of a consolidated checkpoint,
pretrained weights) and copies only its own slice of each unit into its shard;
buffers load into the module. No collective runs, so ranks may load at different
times. Gathered copies are dropped, so the next forward sees the new values.
Optimizer state is untouched, as with ``nn.Module.load_state_dict``.
"""

from __future__ import annotations

import torch

from .units import slot_names


@torch.no_grad()
def full_state_dict(fsdp) -> dict:
    """The consolidated state dict with the original names (a collective: every rank)."""
    out = dict(fsdp.module.state_dict())
    for u in fsdp.units:
        full = torch.empty(u.layout.padded, dtype=u.shard.dtype, device=u.shard.device)
        fsdp.comm.gather(full, u.shard, fsdp.rank, fsdp.shard_group,
                         tag=f"state{u.index}").wait()
        pieces = full[:u.layout.numel].split(list(u.layout.numels))
        for (_mod, _attr, k), name in zip(u.slots, slot_names(fsdp.module, u)):
            out[name] = pieces[k].view(u.shapes[k]).clone()
    return {k: out[k] for k in fsdp.original_keys if k in out}


@torch.no_grad()
def load_full_state_dict(fsdp, state_dict, strict: bool = True):
    """Copy this rank's slices of ``state_dict`` (original names) into the shards.

    Returns ``(missing_keys, unexpected_keys)`` like ``nn.Module.load_state_dict``;
    with ``strict`` either is an error naming the keys, raised before anything changes
    (as is a shape mismatch, always).
    """
    expected = set(fsdp.original_keys)
    missing = [k for k in fsdp.original_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    units = []
    for u in fsdp.units:
        names = slot_names(fsdp.module, u)
        tensors: list = [None] * len(u.shapes)
        for (_mod, _attr, k), name in zip(u.slots, names):
            if name in state_dict and tensors[k] is None:  # tied: any of its names
                tensors[k] = state_dict[name]
        for (_mod, _attr, k), name in zip(u.slots, names):
            t = tensors[k]
            if t is not None and tuple(t.shape) != tuple(u.shapes[k]):
                raise RuntimeError(f"load_state_dict: {name!r} has shape {list(t.shape)} in "
                                   f"the state dict but {list(u.shapes[k])} in the model")
            if t is not None and name in missing:
                missing.remove(name)  # loaded through a tied alias
        units.append((u, tensors))
    if strict and (missing or unexpected):
        raise RuntimeError("load_state_dict into FullyShardedDataParallel: "
                           + "; ".join(f"{what}: {', '.join(map(repr, keys))}"
                                       for what, keys in (("missing", missing),
                                                          ("unexpected", unexpected)) if keys))
    fsdp.release_gathered()
    for u, tensors in units:
        start, end = u.layout.shard_range(fsdp.rank)
        offset = 0
        for numel, t in zip(u.layout.numels, tensors):
            lo, hi = max(start, offset), min(end, offset + numel)
            if t is not None and lo < hi:  # this rank's part of this parameter
                u.shard[lo - start:hi - start] = t.reshape(-1)[lo - offset:hi - offset]
            offset += numel
    own = fsdp.module.state_dict()  # buffers (and frozen parameters) the module still holds
    fsdp.module.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False)
    return missing, unexpected
