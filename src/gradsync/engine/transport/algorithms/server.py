"""Parameter-server all-reduce: every rank sends its tensor to one root, which sums
and sends the result back (Li et al. 2014, "Scaling Distributed Machine Learning
with the Parameter Server").

Two rounds whatever N is, but the root's link carries (N-1) S in and (N-1) S out:
its time grows linearly with the number of workers while a ring's stays about 2S
per rank. It is here as the baseline that shows that saturation in measurement
(``benchmarks/collectives_netlab.py``), not as something to train with.

Fixed reduction order: the root adds the N tensors in group-rank order
(``((x0 + x1) + x2) + ...``) and the others receive a copy, so every rank holds
bitwise the same sum whatever order the messages arrived in.
"""

from __future__ import annotations

import torch

from ....errors import UsageError
from .. import comm
from .rounds import exchange, flat_view, group_rank_size


def all_reduce_(tensor: torch.Tensor, group=None, *, tag: str = "server", root: int = 0) -> None:
    """Sum ``tensor`` over ``group`` in place through group rank ``root`` (blocking)."""
    flat = flat_view(tensor, "server.all_reduce_")
    rank, n = group_rank_size(group)
    if not 0 <= root < n:
        raise UsageError(f"server.all_reduce_: root {root} is not a rank of a group of {n}")
    with comm.composite("all_reduce", tensor, tag, {"algorithm": "server"}):
        if n == 1:
            return
        if rank != root:
            exchange([(flat, root)], [], group)
            exchange([], [(flat, root)], group)
            return
        received = {j: torch.empty_like(flat) for j in range(n) if j != root}

        def total():
            parts = [flat if j == root else received[j] for j in range(n)]
            acc = parts[0] + parts[1]
            for p in parts[2:]:
                acc.add_(p)
            flat.copy_(acc)

        exchange([], [(t, j) for j, t in received.items()], group, finish=total)
        exchange([(flat, j) for j in received], [], group)
