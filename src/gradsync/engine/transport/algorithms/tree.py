"""Binomial-tree all-reduce: reduce to group rank 0 in ceil(log2 N) rounds, broadcast back.

Round k of the reduction pairs rank r (bit k clear) with r + 2^k, which sends its
partial sum and leaves; the broadcast runs the same tree the other way. Latency
is 2 ceil(log2 N) message times against the ring's 2(N-1), but every message is
the whole tensor, so the bandwidth term is 2 ceil(log2 N) S instead of about 2S:
the choice for small messages (MPICH uses it below a few KB; Thakur, Rabenseifner
and Gropp 2005, section 4). Not pipelined: NCCL's trees cut the tensor into
pieces to recover bandwidth, which this reference deliberately does not.

Fixed reduction order: the partial at rank r after round k is ``partial(r) +
partial(r + 2^k)``, a fixed binary tree of additions; rank 0 alone finishes the
sum and every other rank receives a copy, so all ranks hold bitwise the same.
N need not be a power of two.
"""

from __future__ import annotations

import torch

from .. import comm
from .rounds import exchange, flat_view, group_rank_size


def all_reduce_(tensor: torch.Tensor, group=None, *, tag: str = "tree") -> None:
    """Sum ``tensor`` over ``group`` in place (blocking); bitwise equal on every rank."""
    flat = flat_view(tensor, "tree.all_reduce_")
    with comm.composite("all_reduce", tensor, tag, {"algorithm": "tree"}):
        rank, n = group_rank_size(group)
        if n == 1:
            return
        tmp = torch.empty_like(flat)
        mask = 1
        while mask < n:  # reduce towards rank 0
            if rank & mask:
                exchange([(flat, rank - mask)], [], group)
                break
            if rank + mask < n:
                exchange([], [(tmp, rank + mask)], group, finish=lambda: flat.add_(tmp))
            mask <<= 1
        top = 1
        while top < n:
            top <<= 1
        mask = top >> 1
        while mask >= 1:  # broadcast from rank 0 down the same tree
            if rank % (2 * mask) == 0 and rank + mask < n:
                exchange([(flat, rank + mask)], [], group)
            elif rank % (2 * mask) == mask:
                exchange([], [(flat, rank - mask)], group)
            mask >>= 1
