"""What a local-update sync sends: the summed pseudo-gradient, its items, the buffers.

DiLoCo's exchange (arXiv 2311.08105, Algorithm 1) averages
pseudo-gradients over workers; here they are summed together with the items each
worker processed since the last sync, so the outer step can weight each worker by
its data (``diloco.py``). The sum travels by the backend's all-reduce, a
compressor, or the two-level all-reduce when a worker is a host. Buffers
(BatchNorm statistics) are averaged with the same item weights. During a
synchronous warm-up (``schedule.py``) gradients travel instead, summed with items
as gradsync's exact data parallelism sums them (:func:`mean_gradients`).

Every figure of :class:`DiLoCoStats` is this rank's bytes on the wire, an exact
all-reduce counted as 2 (N-1)/N of its size (``compress.base.ring_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..compress import Compressor, parse_compression
from ..compress.base import ring_bytes
from ..sync.item_window import as_count
from ..sync.replicas import broadcast_tensors
from ..transport import comm, host
from ..transport.algorithms import hierarchical
from ..transport.algorithms.topology import HostTopology


def as_items(num_items) -> float:
    """Items of one inner step: ``None`` counts one (every worker takes the same steps)."""
    return 1.0 if num_items is None else as_count(num_items)


def resolve_compressor(compress) -> Compressor | None:
    if compress is None or isinstance(compress, Compressor):
        return compress
    if isinstance(compress, str):
        return parse_compression(compress)
    raise UsageError(f"compress must be None, a string like 'int8' or a Compressor, "
                     f"got {type(compress).__name__}")


@dataclass(frozen=True)
class DiLoCoStats:
    """Communication of this rank so far.

    bytes_sent: what this rank put on the wire for pseudo-gradients, item counts and
        buffers (exact all-reduces counted as 2 (N-1)/N of their size).
    exact_bytes: the same for uncompressed pseudo-gradients.
    """

    steps: int
    syncs: int
    bytes_sent: int
    exact_bytes: int
    last_sync_bytes: int

    @property
    def bytes_per_sync(self) -> float:
        return self.bytes_sent / self.syncs if self.syncs else 0.0

    @property
    def ratio(self) -> float:
        return self.exact_bytes / self.bytes_sent if self.bytes_sent else math.nan


def sum_with_items(compressor: Compressor | None, key: int, shapes, flat: torch.Tensor,
                   items: float, group, step=None):
    """Sum ``flat`` and the item counts over ranks (blocking).

    Returns (flat, total items, bytes sent, bytes an exact all-reduce would send).
    ``group`` may be a :class:`HostTopology`: the two-level all-reduce over the world
    (what a rank sends is the same 2 (N-1)/N of the size as a flat ring's; half or
    more of it stays inside the host).

    Touches only its arguments: streaming DiLoCo runs it on a thread.
    """
    topology = group if isinstance(group, HostTopology) else None
    group = None if topology is not None else group
    count = torch.tensor([items], dtype=torch.float64, device=flat.device)
    world = dist.get_world_size(group)
    if topology is not None:
        hierarchical.all_reduce_(flat, topology, tag="diloco")
        sent = ring_bytes(flat.numel() * flat.element_size(), world)
        # the count too only on the topology's groups (integers: exact in any order):
        # streaming DiLoCo's thread owns its topology, and a count summed on the world
        # group from there raced the main thread's collectives on it (a hang)
        for on in (topology.intra_group, topology.inter_group):
            comm.all_reduce(count, on, tag="diloco-items")
    else:
        pending = comm.all_reduce(count, group, async_op=True, tag="diloco-items")
        if compressor is None:
            comm.all_reduce(flat, group, tag="diloco", meta={"fragment": key, "step": step})
            sent = ring_bytes(flat.numel() * flat.element_size(), world)
        else:
            before = compressor.stats().sent_bytes
            compressor.all_reduce_(key, flat, shapes, group)
            sent = compressor.stats().sent_bytes - before
        pending.wait()
    header = ring_bytes(count.numel() * count.element_size(), world)
    exact = ring_bytes(flat.numel() * flat.element_size(), world)
    return flat, float(host.read(count)[0]), sent + header, exact + header


def average_buffers(float_buffers: list[torch.Tensor], other_buffers: list[torch.Tensor],
                    items: float, group) -> int:
    """Item-weighted average of float buffers, rank 0's integer buffers; bytes sent."""
    if not (float_buffers or other_buffers):
        return 0
    world = dist.get_world_size(group)
    sent = 0
    if float_buffers:
        dtype = torch.float64
        device = float_buffers[0].device
        flat = torch.cat([b.detach().reshape(-1).to(dtype) * items for b in float_buffers]
                         + [torch.tensor([items], dtype=dtype, device=device)])
        comm.all_reduce(flat, group, tag="diloco-buffers")
        sent += ring_bytes(flat.numel() * flat.element_size(), world)
        total = float(host.read(flat[-1:])[0])
        if total > 0:
            offset = 0
            with torch.no_grad():
                for b in float_buffers:
                    k = b.numel()
                    b.copy_(flat[offset:offset + k].view_as(b) / total)
                    offset += k
    if other_buffers:
        broadcast_tensors(other_buffers, group, tag="diloco-buffers")
        sent += sum(b.numel() * b.element_size() for b in other_buffers)
    return sent


def mean_gradients(params: list[torch.Tensor], weight: float, items: float, group) -> int:
    """One synchronous step's gradient: ``p.grad <- sum over ranks (weight * p.grad) / sum
    of items``, identical on every rank; bytes sent.

    A worker whose ``p.grad`` holds the sum over its items passes weight 1 and its
    item count (gradsync's exact weighting: the mean over the global batch); one
    holding its own mean passes its items twice. A missing ``.grad`` counts as zeros
    (a worker without data) and every parameter leaves with a gradient.
    """
    if not params:
        return 0
    dtype = params[0].dtype
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                      .detach().reshape(-1).to(dtype) for p in params])
    if weight != 1:
        flat.mul_(weight)
    count = torch.tensor([items], dtype=torch.float64, device=flat.device)
    pending = comm.all_reduce(count, group, async_op=True, tag="diloco-warmup-items")
    comm.all_reduce(flat, group, tag="diloco-warmup")
    pending.wait()
    total = float(host.read(count)[0])
    if total > 0:
        flat.div_(total)
    offset = 0
    with torch.no_grad():
        for p in params:
            k = p.numel()
            part = flat[offset:offset + k].view_as(p)
            if p.grad is None:
                p.grad = part.to(p.dtype).clone()
            else:
                p.grad.copy_(part)
            offset += k
    world = dist.get_world_size(group)
    return ring_bytes(flat.numel() * flat.element_size() + 8, world)
