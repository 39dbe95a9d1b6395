"""Establish, rather than trust, that every replica starts identical.

Two steps at construction: check that all ranks hold the same parameter and
buffer names, shapes and dtypes (a 32-byte digest per rank in one small
collective; the full listing is gathered only when digests differ, to name the
first mismatch), then broadcast rank 0's values. A mismatch raises the same
message on every rank, so no rank is left waiting in a collective.

Also here, because every wrapper's ``load_state_dict`` needs it: a checkpoint torch
DDP saved (every key ``module.``-prefixed) renamed to the module's own keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parameter import is_lazy

from ...dist import comm_device
from ...errors import ReplicaMismatchError, UsageError
from ..transport import comm, host

_CHUNK_BYTES = 64 * 1024 * 1024


def check_module_device(module: nn.Module, group=None, what: str = "DataParallel") -> None:
    """Every parameter and buffer on the communication device, or one line naming the
    first that is not and the fix. Buckets and shards are allocated beside the
    parameters and the collectives run on the group's device: a CPU model under NCCL
    (or a GPU model under gloo) fails later, inside torch, far from the cause."""
    dev = comm_device(group)
    ignored = ignored_names(module)
    for kind, items in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in items:
            if name in ignored or t.device == dev or (t.device.type == dev.type == "cpu"):
                continue
            backend = dist.get_backend(group)
            fix = ("model.to(gs.init().device) before wrapping it"
                   + (", or --backend gloo to train on the CPU" if dev.type == "cuda" else "")
                   + (", or --backend nccl to train on GPUs" if t.device.type == "cuda"
                      and dev.type == "cpu" else ""))
            raise UsageError(f"{what}: {kind} {name!r} is on {t.device}, but the process "
                             f"group ({backend}) communicates on {dev}: {fix}")


def ignored_names(module: nn.Module) -> frozenset[str]:
    """Parameters and buffers torch DDP leaves alone, set with
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)``
    (e.g. state sharded by other means): not checked, broadcast nor synchronised."""
    return frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def structure(module: nn.Module, ignore=frozenset()) -> list[tuple[str, str, tuple[int, ...],
                                                                  str, bool]]:
    """(kind, name, shape, dtype, requires_grad) of every parameter and buffer, in order;
    the shape of a lazy module's uninitialized parameter is the string ``UNINITIALIZED``."""
    rows = [
        ("param", n, _shape(p), str(p.dtype), p.requires_grad)
        for n, p in module.named_parameters() if n not in ignore
    ]
    rows += [("buffer", n, _shape(b), str(b.dtype), False)
             for n, b in module.named_buffers() if n not in ignore]
    return rows


UNINITIALIZED = "uninitialized"


def _shape(t: torch.Tensor) -> tuple[int, ...] | str:
    return UNINITIALIZED if is_lazy(t) else tuple(t.shape)


def _describe(row) -> str:
    if row is None:
        return "no such entry"
    kind, name, shape, dtype, rg = row
    frozen = "" if kind == "buffer" or rg else " (frozen)"
    shape = shape if shape == UNINITIALIZED else tuple(shape)
    return f"{kind} {name!r} shape {shape} {dtype.replace('torch.', '')}{frozen}"


def first_mismatch(listings: list[list]) -> str | None:
    """Describe the first entry where ranks disagree, naming it and the ranks involved."""
    longest = max(len(rows) for rows in listings)
    for i in range(longest):
        rows = [r[i] if i < len(r) else None for r in listings]
        if all(r == rows[0] for r in rows):
            continue
        name = next(r[1] for r in rows if r is not None)
        differing = [k for k, r in enumerate(rows) if r != rows[0]]
        parts = [f"rank 0 has {_describe(rows[0])}"]
        parts += [f"rank {k} has {_describe(rows[k])}" for k in differing]
        ranks = ", ".join(str(k) for k in [0, *differing])
        return f"model differs across ranks at {name!r} (entry #{i}; ranks {ranks}): " + "; ".join(
            parts
        )
    return None


def _listings_if_different(rows: list, group) -> list | None:
    """Every rank's ``rows`` when some rank's differ (one digest all-gather when they
    agree, the full listings only when they do not); None when all agree."""
    digest = hashlib.sha256(repr(rows).encode()).digest()
    dev = comm_device(group)
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=dev)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * len(digest), dtype=torch.uint8, device=dev)
    comm.all_gather_single(everyone, mine, group=group, tag="verify")
    digests = host.read(everyone.view(world, -1))
    if bool((digests == digests[0]).all()):
        return None
    return comm.all_gather_object(rows, group=group, tag="verify-listings")


def verify_same_structure(module: nn.Module, group=None, what: str = "DataParallel") -> None:
    """Raise ReplicaMismatchError on every rank if any rank's model differs, and a
    UsageError on every rank if a lazy module is still uninitialized (compared first, so
    one rank that ran its dummy forward and another that did not is a mismatch, not a
    hang)."""
    rows = structure(module, ignored_names(module))
    listings = _listings_if_different(rows, group)
    if listings is not None:
        detail = first_mismatch(listings) or "structure digests differ"
        raise ReplicaMismatchError(f"{what}: {detail}")
    lazy = [name for _kind, name, shape, *_ in rows if shape == UNINITIALIZED]
    if lazy:
        raise UsageError(f"{what}: {len(lazy)} parameter(s) of a lazy module are not "
                         f"initialized yet ({', '.join(map(repr, lazy[:3]))}"
                         f"{', ...' if len(lazy) > 3 else ''}): run one forward pass with a "
                         "sample input before wrapping, as torch DDP requires")


def verify_same_setup(settings: dict, group=None, what: str = "DataParallel") -> None:
    """Raise ReplicaMismatchError on every rank if any rank's settings differ.

    Settings that decide the collectives (bucket caps, a ZeRO stage, FSDP's units):
    ranks built differently would exchange messages of different sizes, which the
    backend reports as an abort or a hang, not as the setting that differed.
    """
    rows = [(k, repr(v)) for k, v in settings.items()]
    listings = _listings_if_different(rows, group)
    if listings is None:
        return
    for i, (key, value) in enumerate(listings[0]):
        others = [(r, rows_r[i][1]) for r, rows_r in enumerate(listings) if rows_r[i][1] != value]
        if others:
            theirs = "; ".join(f"rank {r}: {v}" for r, v in others)
            raise ReplicaMismatchError(f"{what}: {key} differs across ranks (rank 0: {value}; "
                                       f"{theirs}); build it the same way on every rank")
    raise ReplicaMismatchError(f"{what}: settings differ across ranks")


def _chunks(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    chunk, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > _CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += nbytes
    if chunk:
        yield chunk


def broadcast_tensors(
    tensors: list[torch.Tensor], group=None, src_rank: int = 0, tag: str = "broadcast"
) -> None:
    """Overwrite ``tensors`` in place with ``src_rank``'s values, coalesced by dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    dev = comm_device(group)
    for dtype in sorted(by_dtype, key=str):
        for chunk in _chunks(by_dtype[dtype]):
            flat = torch.cat([t.detach().reshape(-1).to(dev) for t in chunk])
            comm.broadcast(flat, src_rank=src_rank, group=group, tag=tag)
            offset = 0
            with torch.no_grad():
                for t in chunk:
                    n = t.numel()
                    # through .data, as torch DDP's broadcast: the version counter stays, so a
                    # graph that saved a buffer (BatchNorm, two forwards before one backward)
                    # still backpropagates
                    t.data.copy_(flat[offset : offset + n].view_as(t))
                    offset += n


def broadcast_module_state(module: nn.Module, group=None, src_rank: int = 0) -> None:
    """Copy ``src_rank``'s parameters and buffers into every other rank's module."""
    ignore = ignored_names(module)
    tensors = ([p.data for n, p in module.named_parameters() if n not in ignore]
               + [b for n, b in module.named_buffers() if n not in ignore])
    broadcast_tensors(tensors, group, src_rank, tag="init-broadcast")

def without_ddp_prefix(state_dict, own_keys):
    """A checkpoint torch DDP saved (``ddp.state_dict()``: every key ``module.``-prefixed),
    renamed to the module's own keys, so ``wrapper.load_state_dict(torch.load(...))``
    works for a user switching from DDP with checkpoints in hand. Only when *every* key
    carries the prefix and none of the module's own keys do (a module with a child
    named ``module`` is left alone); a copy is renamed, the caller's dict is not."""
    prefix = "module."
    if (not state_dict or any(k.startswith(prefix) for k in own_keys)
            or not all(k.startswith(prefix) for k in state_dict)):
        return state_dict
    renamed = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-module versions (BatchNorm's): renamed with the keys
        renamed._metadata = OrderedDict(metadata)
    consume_prefix_in_state_dict_if_present(renamed, prefix)
    return renamed
