"""Two-level collectives: the slow inter-host link carries each byte once per host.

All-reduce over H hosts of g ranks (the bandwidth-optimal two-level scheme of
Thakur, Rabenseifner and Gropp 2005 applied to hosts; as in Horovod's and NCCL's
hierarchical modes, and Goyal et al. arXiv 1706.02677, section 4):

1. reduce-scatter inside each host (ring over the g local ranks): local rank l
   holds its host's sum of chunk l (1/g of the tensor);
2. all-reduce chunk l across hosts among the g inter-host groups in parallel
   (ring by default): each host's link carries 2(H-1)/H of the tensor in total,
   against 2(N-1)/N for a flat ring over all N = H g ranks whose every round
   crosses a host boundary;
3. all-gather inside each host.

Fixed reduction order: each element is summed once (inside a host in ring order,
then across hosts in ring order) and only copied afterwards, so every rank holds
bitwise the same result. It is not the same rounding as a flat ring's order.

``reduce_scatter`` and ``all_gather`` are the same two levels for ZeRO's shard
layout (rank r owns slice r of the rank-major flat buffer); they permute the
buffer so that each local rank's column of slices is contiguous (one extra copy
of the tensor in memory, far cheaper than the inter-host bytes it saves).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ....errors import UsageError
from .. import comm
from . import ring
from .rounds import chunk_bounds, flat_view
from .topology import HostTopology

AllReduce = Callable[..., None]


def _check(topology, where: str) -> None:
    if not isinstance(topology, HostTopology):
        raise UsageError(f"{where}: second argument must be a HostTopology, "
                         f"got {type(topology).__name__}")


def all_reduce_(tensor: torch.Tensor, topology: HostTopology, *, tag: str = "hierarchical",
                inter: AllReduce = ring.all_reduce_) -> None:
    """Sum ``tensor`` over every rank of ``topology`` in place (blocking).

    ``inter``: the all-reduce run across hosts on each chunk, called as
    ``inter(chunk, topology.inter_group, tag=tag)`` (``ring``, ``tree`` or
    ``server`` ``.all_reduce_``, or any function of that signature).
    """
    _check(topology, "hierarchical.all_reduce_")
    flat = flat_view(tensor, "hierarchical.all_reduce_")
    with comm.composite("all_reduce", tensor, tag, {"algorithm": "hierarchical"}):
        g = topology.ranks_per_host
        bounds = chunk_bounds(flat.numel(), g)
        ring.reduce_scatter_chunks_(flat, bounds, topology.intra_group)
        mine = topology.local_rank
        if topology.num_hosts > 1:
            inter(flat[bounds[mine]:bounds[mine + 1]], topology.inter_group, tag=tag)
        ring.all_gather_chunks_(flat, bounds, topology.intra_group)


def _shard_numel(full: torch.Tensor, topology: HostTopology, where: str) -> int:
    n, world = full.numel(), topology.world_size
    if n % world:
        raise UsageError(f"{where}: {n} elements do not divide into {world} equal shards "
                         "(pad the flat buffer to a multiple of the world size)")
    return n // world


def _columns(topology: HostTopology, shard: int) -> list[int]:
    """Bounds of the column layout: column l = slices (h g + l) for h = 0..H-1, in h order."""
    col = topology.num_hosts * shard
    return [j * col for j in range(topology.ranks_per_host + 1)]


def _to_columns(full: torch.Tensor, topology: HostTopology, shard: int) -> torch.Tensor:
    """Rank-major [H, g, shard] -> column-major [g, H, shard] (a copy)."""
    h, g = topology.num_hosts, topology.ranks_per_host
    cols = torch.empty_like(full)  # never a view of ``full`` (contiguous() may return one)
    cols.view(g, h, shard).copy_(full.view(h, g, shard).transpose(0, 1))
    return cols


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: HostTopology, *,
                   tag: str = "hierarchical") -> None:
    """Sum ``input`` (N x shard elements, rank-major) over all ranks; rank r gets slice r
    in ``output`` (shard elements). ``input`` is left unchanged. Blocking."""
    _check(topology, "hierarchical.reduce_scatter")
    full = flat_view(input, "hierarchical.reduce_scatter")
    out = flat_view(output, "hierarchical.reduce_scatter output")
    shard = _shard_numel(full, topology, "hierarchical.reduce_scatter")
    if out.numel() != shard:
        raise UsageError(f"hierarchical.reduce_scatter: output has {out.numel()} elements, "
                         f"expected {shard} (input / world size)")
    with comm.composite("reduce_scatter", input, tag, {"algorithm": "hierarchical"}):
        cols = _to_columns(full, topology, shard)
        ring.reduce_scatter_chunks_(cols, _columns(topology, shard), topology.intra_group)
        j, h = topology.local_rank, topology.host
        mine = cols[j * topology.num_hosts * shard:(j + 1) * topology.num_hosts * shard]
        ring.reduce_scatter_chunks_(mine, [k * shard for k in range(topology.num_hosts + 1)],
                                    topology.inter_group)
        out.copy_(mine[h * shard:(h + 1) * shard])


def all_gather(output: torch.Tensor, input: torch.Tensor, topology: HostTopology, *,
               tag: str = "hierarchical") -> None:
    """Fill ``output`` (N x shard, rank-major) with every rank's ``input`` (shard). Blocking."""
    _check(topology, "hierarchical.all_gather")
    full = flat_view(output, "hierarchical.all_gather output")
    shard_in = flat_view(input, "hierarchical.all_gather")
    shard = _shard_numel(full, topology, "hierarchical.all_gather")
    if shard_in.numel() != shard:
        raise UsageError(f"hierarchical.all_gather: input has {shard_in.numel()} elements, "
                         f"expected {shard} (output / world size)")
    with comm.composite("all_gather", output, tag, {"algorithm": "hierarchical"}):
        h_count, g = topology.num_hosts, topology.ranks_per_host
        cols = torch.empty_like(full)
        j, h = topology.local_rank, topology.host
        mine = cols[j * h_count * shard:(j + 1) * h_count * shard]
        mine[h * shard:(h + 1) * shard].copy_(shard_in)
        ring.all_gather_chunks_(mine, [k * shard for k in range(h_count + 1)],
                                topology.inter_group)
        ring.all_gather_chunks_(cols, _columns(topology, shard), topology.intra_group)
        full.view(h_count, g, shard).copy_(cols.view(g, h_count, shard).transpose(0, 1))
