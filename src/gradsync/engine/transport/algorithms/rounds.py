"""What every reference algorithm shares: chunk bounds, flat views, one exchange round.

Each round of an algorithm is one ``comm.exchange`` (point-to-point isend/irecv
through the engine's one door for communication) that returns when all of its
messages have completed. Every message of these algorithms uses one gloo tag,
``P2P_TAG``, outside the range ``ShardComm`` draws its tags from, so a sharded
strategy's pairwise exchanges on the same group never match one of these. Within
one operation, messages between a pair of ranks are matched in the order posted,
which is the same on both sides by construction; two operations on one group at
the same time (two threads) are not supported -- run them from one
communication thread, in the same order on every rank.

A round is one ``comm.exchange``, which posts it as one ``batch_isend_irecv``: with
NCCL, a send and a receive to the same peer issued as separate calls share one
stream, which serialises them and deadlocks a pair sending to each other
(``nccl_rules.py`` refuses that on gloo, and CI runs these algorithms under it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....errors import UsageError
from .. import comm

P2P_TAG = 1 << 25  # ShardComm's tags are in [0, 2**24)


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` offsets splitting ``numel`` items; the first ``numel % parts`` chunks
    are one item longer (sizes differ by at most one, so a ring's rounds stay balanced)."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def flat_view(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """A 1-D view sharing ``tensor``'s storage (in-place algorithms need one)."""
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{where}: expected a tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise UsageError(f"{where}: tensor must be contiguous (shape {tuple(tensor.shape)}, "
                         f"strides {tensor.stride()}); pass tensor.contiguous() and copy back")
    return tensor.view(-1)


def group_rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def exchange(sends, recvs, group, finish=None, p2p_tag: int = P2P_TAG) -> None:
    """One blocking round: ``sends``/``recvs`` are ``[(tensor, group rank), ...]``.

    Receives are posted before sends, in the same group call. On gloo that order
    decides whether a pair of ranks sending to each other uses both directions of
    their one connection at once: measured between two emulated hosts at 100 Mbit/s
    (4 MB each way, 5 repetitions), sends first took 609-705 ms, receives first
    354-381 ms, the link's rate. Empty tensors are left out on both sides (each side
    computes the same sizes), so chunks of a tensor smaller than the group cost no
    message.
    """
    sends = [(t, r) for t, r in sends if t.numel()]
    recvs = [(t, r) for t, r in recvs if t.numel()]
    if not sends and not recvs:
        if finish is not None:
            finish()
        return
    comm.exchange("p2p", (sends or recvs)[0][0], sends, recvs, group=group,
                  p2p_tag=p2p_tag, finish=finish)
