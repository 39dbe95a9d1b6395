"""The exact sum over a step's quorum: gradients weighted by their items, one division.

Inside a group the strategy has already produced its exact mean gradient over the
group's items (``backward(loss, num_items=n)``). Across groups torchft's
``Manager.allreduce`` would *average over participants*, so a group with fewer
items would count as much as a full one. Here instead each group's mean is
multiplied back by its item count ``n_G``, summed over the quorum, and divided by
the quorum's total ``N = sum n_G``: the mean over every item of the global batch,
as one process on the whole batch computes it (the ``n_G / n_G`` round trip costs
one rounding, far below the 1e-12 the tests hold float64 runs to).

Which tensors cross: what this rank owns after the group's reduction. Sharded
strategies (zero1-3) own a slice (``grad_shards``), and rank ``j`` of every group
holds the same slice, so it sums its slice over its own cross-group process
group. A replicated strategy (ddp) holds the whole gradient on every rank; rank
``j`` sends only chunk ``j`` of ``W`` across groups and the group all-gathers the
chunks back, so the slow link carries one gradient per group, not ``W``.

A header travels beside the gradient: ``[n_G, loss sum, one-hot group index]``,
so every rank learns the global item count, the exact global loss, and which
groups the step's sum holds. Sharded strategies add which parameters their group
used (``--find-unused-parameters``: a parameter no rank of the group used has no
gradient there and would not be stepped): a parameter any group used is stepped
in every group, on the quorum's sum, as one process on the whole batch steps it.

Failures: torchft's allreduce swallows a peer's death and marks the manager
errored; this function then still runs the group's all-gather (every rank of the
group calls the same collectives, whatever its own cross-group link saw) and
returns, and ``Manager.should_commit`` turns the error into a step that every
group redoes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

from ..engine.transport import comm
from .shares import even_counts


@dataclass(frozen=True)
class QuorumSums:
    """What the quorum's header summed to (meaningless when the manager errored)."""

    items: float
    loss_sum: float
    members: tuple[int, ...]  # group indices whose contributions the sum holds
    sent_bytes: int  # this rank's cross-group traffic, a ring all-reduce's 2(Q-1)/Q per byte


def shard_owner(strategy):
    """What holds this rank's gradient shards (a ZeroOptimizer, a zero3 model), or None."""
    return strategy.shard_owner()


def owned_gradients(strategy) -> tuple[list[torch.Tensor], bool]:
    """(this rank's synchronised gradient tensors, whether they are shards)."""
    owner = shard_owner(strategy)
    if owner is not None:
        return [g for g in owner.grad_shards() if g is not None], True
    grads = []
    for p in strategy.module.parameters():
        if p.requires_grad:
            if p.grad is None:  # unused this step: a zero gradient, the same in every group
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    return grads, False


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    return torch.cat([g.detach().reshape(-1).to(dtype) for g in grads])


def _scatter_back(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    at = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[at:at + n].view_as(g))
        at += n


def cross_reduce(manager, strategy, items: float, loss_sum: float, group_rank: int,
                 group_world: int, group_index: int, groups: int) -> QuorumSums:
    """Replace this rank's gradient by the quorum's exact mean; return the header's sums."""
    grads, sharded = owned_gradients(strategy)
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.tensor([float(items), float(loss_sum)], dtype=torch.float64, device=device)
    comm.all_reduce(local, tag="ft_group_items")  # the group's n_G and loss sum
    n_group = float(local[0])
    owner = shard_owner(strategy) if sharded else None
    used = owner.grad_used() if hasattr(owner, "grad_used") else []
    header = torch.zeros(2 + groups + len(used), dtype=torch.float64, device=device)
    header[:2] = local
    header[2 + group_index] = 1.0
    header[2 + groups:] = torch.tensor(used, dtype=torch.float64, device=device)
    flat = _flat(grads) if grads else torch.zeros(0, device=device)
    if sharded:
        mine = flat
    else:
        counts = even_counts(flat.numel(), group_world)
        start = sum(counts[:group_rank])
        mine = flat[start:start + counts[group_rank]].clone()
    mine.mul_(n_group)
    works = [manager.allreduce(header, reduce_op=ReduceOp.SUM)]
    if mine.numel():
        works.append(manager.allreduce(mine, reduce_op=ReduceOp.SUM))
    for w in works:
        w.wait()
    total = float(header[0]) if float(header[0]) > 0 else 1.0  # garbage after an error
    mine.div_(total)
    if not sharded:
        flat = _gather_chunks(mine, flat.numel(), group_world, flat.dtype)
    else:
        flat = mine
    if grads:
        _scatter_back(flat, grads)
    if used:  # used by a rank of any group: stepped in every group (ddp: a zero .grad)
        owner.set_grad_used([u > 0.5 for u in header[2 + groups:].tolist()])
    members = tuple(k for k in range(groups) if header[2 + k] > 0.5)
    q = max(len(members), 1)
    wire = (mine.numel() * mine.element_size() + header.numel() * header.element_size())
    return QuorumSums(items=float(header[0]), loss_sum=float(header[1]), members=members,
                      sent_bytes=int(2 * (q - 1) / q * wire))


def _gather_chunks(mine: torch.Tensor, numel: int, group_world: int, dtype) -> torch.Tensor:
    """Every rank's chunk, concatenated (chunks differ by at most one element: padded)."""
    counts = even_counts(numel, group_world)
    width = max(counts) if counts else 0
    if group_world == 1:
        return mine
    padded = torch.zeros(width, dtype=dtype, device=mine.device)
    padded[:mine.numel()] = mine
    out = torch.empty(width * group_world, dtype=dtype, device=mine.device)
    comm.all_gather_single(out, padded, tag="ft_chunks")
    return torch.cat([out[k * width:k * width + c] for k, c in enumerate(counts)])
