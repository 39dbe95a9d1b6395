"""Compression across hosts only: exact sums inside a host, compressed ones between hosts.

Why: compression pays where the link is slow, and with several ranks per host the
slow link is the one between hosts. The two-level all-reduce
(``transport/algorithms/hierarchical.py``) already sends each byte across it once
per host instead of once per rank; this module swaps its middle step, the
inter-host all-reduce, for a compressor. Per bucket, with H hosts of g ranks:

1. reduce-scatter inside each host (ring, exact): local rank l holds its host's
   exact sum of chunk l;
2. local rank l of every host reduces chunk l over the inter-host group l with
   the compressor (``Compressor.all_reduce_``, unchanged): the slow link carries
   each host's already-summed gradient, compressed, and the g inter-host groups
   run side by side;
3. all-gather inside each host (exact copies).

Error feedback is the compressor's own: its state is keyed by the bucket index,
and local rank l always holds chunk l, so the residual carried to the next step is
what compressing this host's sum of that chunk lost. Every rank ends with bitwise
the same bytes: step 1 sums in ring order, step 2's result is bitwise identical
across its group (the compressor's contract), step 3 copies. One host: nothing
crosses a slow link, so the result is the exact two-level sum. One rank per host:
step 2 alone, the plain compressor over the world.

Chunks: even, for an elementwise codec (bf16, fp16, int8); for a compressor that
needs whole tensors (PowerSGD factorises each gradient matrix), chunks end at
tensor boundaries, as near the even split as they can, so one large matrix can
leave a chunk bigger than the others (or some empty).
"""

from __future__ import annotations

import math

import torch

from ..transport import comm
from ..transport.algorithms import hierarchical, ring
from ..transport.algorithms.rounds import chunk_bounds
from ..transport.algorithms.topology import HostTopology, host_topology
from .base import Compressor, payload_numel
from .reduction import CompressedBuckets


def host_chunks(shapes, parts: int, whole_tensors: bool):
    """(bounds, shapes per chunk): ``parts`` chunks of the tensors ``shapes`` laid end to end.

    ``whole_tensors`` False: ``chunk_bounds`` (sizes differ by at most one), each chunk
    one flat tensor. True: every bound is a tensor boundary, the one nearest the even
    split (never before the previous bound), each chunk the list of its tensors.
    """
    sizes = [math.prod(s) for s in shapes]
    total = sum(sizes)
    if not whole_tensors:
        bounds = chunk_bounds(total, parts)
        return bounds, [[torch.Size([hi - lo])] for lo, hi in zip(bounds, bounds[1:])]
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    bounds, cut = [0], [0]  # cut[k]: index into ends of bound k
    for k in range(1, parts):
        target = k * total / parts
        i = min(range(cut[-1], len(ends)), key=lambda j: (abs(ends[j] - target), j))
        bounds.append(ends[i])
        cut.append(i)
    bounds.append(total)
    cut.append(len(ends) - 1)
    chunks = [[torch.Size(s) for s in shapes[cut[k]:cut[k + 1]]] for k in range(parts)]
    return bounds, chunks


def all_reduce_(compressor: Compressor, key: int, flat: torch.Tensor, shapes,
                topology: HostTopology, *, tag: str = "hierarchical") -> None:
    """Replace ``flat[:T]`` by its sum over every rank: exact inside each host, through
    ``compressor`` between hosts (the module docstring). ``flat[T:]`` is not touched.

    Blocking; every rank calls it with the same keys in the same order, on one thread
    that alone uses ``topology``'s groups meanwhile (as ``Compressor.all_reduce_``).
    """
    total = payload_numel(flat, shapes, key)
    x = flat[:total]
    g, mine = topology.ranks_per_host, topology.local_rank
    with comm.composite("all_reduce", x, tag, {"algorithm": "hierarchical",
                                               "codec": compressor.name}):
        bounds, chunk_shapes = host_chunks(shapes, g, compressor.whole_tensors)
        ring.reduce_scatter_chunks_(x, bounds, topology.intra_group)
        if bounds[mine + 1] > bounds[mine]:  # the same on every host: all call, or none
            compressor.all_reduce_(key, x[bounds[mine]:bounds[mine + 1]], chunk_shapes[mine],
                                   topology.inter_group)
        ring.all_gather_chunks_(x, bounds, topology.intra_group)


class HostCompressedBuckets(CompressedBuckets):
    """DataParallel buckets compressed across hosts only (``--compress X --collectives
    hierarchical``): ``gs.DataParallel(module, reduction=HostCompressedBuckets(c, topo))``.

    The exact windows (before the bucket rebuild) take the exact two-level sum, the
    later ones :func:`all_reduce_`, both on the compression thread, which owns the
    topology's groups. ``compressor.stats()`` then counts what crossed the slow link
    (what a ``--compress`` run reports as ``sent_bytes``), not the intra-host copies.

    topology: a :class:`HostTopology` (default: torchrun's hosts, built at attach, so
        every rank constructs the DataParallel at the same point).
    """

    def __init__(self, compressor: Compressor, topology: HostTopology | None = None, **kw):
        super().__init__(compressor, **kw)
        self.topology = topology

    def attach(self, dp) -> None:
        if self._thread is None:
            self.topology = host_topology(self.topology)
        super().attach(dp)

    def exact_sum_(self, bucket, src):
        return self._thread.submit(hierarchical.all_reduce_, src, self.topology,
                                   tag=f"bucket{bucket.spec.index}")

    def compressed_sum_(self, key: int, src, shapes):
        return self._thread.submit(all_reduce_, self.compressor, key, src, shapes,
                                   self.topology, tag=f"bucket{key}")
