"""Ring all-reduce: a reduce-scatter then an all-gather around the ranks of a group.

Each of the 2(N-1) rounds sends one of N chunks to the right neighbour and
receives one from the left, so every rank moves 2(N-1)/N of the tensor whatever N
is -- bandwidth-optimal, which is why it replaced the parameter server
(Patarasuk and Yuan 2009; Thakur, Rabenseifner and Gropp 2005, section 4).
Latency grows as 2(N-1) message times.

Fixed reduction order: chunk c is summed along the ring in one fixed sequence,
starting at rank c+1 and ending at rank c (``x[c+1] + x[c+2] + ... + x[c]``),
and the finished chunk is then only copied. Every rank therefore holds bitwise
the same sum, whatever the message timing.

The chunk-level halves are exposed for the hierarchical algorithm: after
``reduce_scatter_chunks_`` group rank r holds the sum of chunk r (not r+1 as in
the textbook indexing, so a rank's chunk is its own index).
"""

from __future__ import annotations

import torch

from .. import comm
from .rounds import chunk_bounds, exchange, flat_view, group_rank_size


def reduce_scatter_chunks_(flat: torch.Tensor, bounds, group) -> None:
    """In place: afterwards chunk ``rank`` of ``flat`` holds the sum over the group."""
    rank, n = group_rank_size(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    width = max(bounds[i + 1] - bounds[i] for i in range(n))
    tmp = torch.empty(width, dtype=flat.dtype, device=flat.device)

    def chunk(c):
        c %= n
        return flat[bounds[c]:bounds[c + 1]]

    for s in range(n - 1):
        out, into = chunk(rank - 1 - s), chunk(rank - 2 - s)
        got = tmp[:into.numel()]
        exchange([(out, right)], [(got, left)], group, finish=lambda i=into, g=got: i.add_(g))


def all_gather_chunks_(flat: torch.Tensor, bounds, group) -> None:
    """In place: every rank contributes chunk ``rank``; afterwards all chunks are everywhere."""
    rank, n = group_rank_size(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n

    def chunk(c):
        c %= n
        return flat[bounds[c]:bounds[c + 1]]

    for s in range(n - 1):
        exchange([(chunk(rank - s), right)], [(chunk(rank - s - 1), left)], group)


def all_reduce_(tensor: torch.Tensor, group=None, *, tag: str = "ring") -> None:
    """Sum ``tensor`` over ``group`` in place (blocking); bitwise equal on every rank."""
    flat = flat_view(tensor, "ring.all_reduce_")
    with comm.composite("all_reduce", tensor, tag, {"algorithm": "ring"}):
        _, n = group_rank_size(group)
        if n == 1:
            return
        bounds = chunk_bounds(flat.numel(), n)
        reduce_scatter_chunks_(flat, bounds, group)
        all_gather_chunks_(flat, bounds, group)
