"""DiLoCo across replica groups: a group is one DiLoCo worker, its sync goes through the quorum.

The DiLoCo paper's workers are islands of accelerators that train synchronously
inside and exchange only pseudo-gradients between them (arXiv 2311.08105). Here
an island is a replica group: its ranks run gradsync's exact ddp for the inner
steps, and only the outer syncs cross between groups, through torchft's
``Manager.allreduce`` over the quorum taken when the sync is due
(``train/ft_local.py`` decides when, and what a sync that does not commit does).

Weighting, as in ``engine/local/diloco.py``: each group's pseudo-gradient
(global copy minus its replica) is multiplied by the items the group trained
since the last sync, summed over the quorum and divided by the sum of the
weights of the groups present. A group that was not in the quorum (it died)
contributes nothing, and one that has just healed from a peer has trained
nothing of its own: weight 0. With one rank per group and no failure this is the
plain multi-worker DiLoCo's sum, so the two runs agree to rounding (tested).

What crosses, per rank ``j`` of a group: chunk ``j`` of the flat pseudo-gradient
(every rank of the group holds the same one), then the group all-gathers the
summed chunks -- the slow link carries one pseudo-gradient per group, not W.
Beside it a float64 header: each group's weight at its own index, a one-hot of
the groups present, and the buffers (BatchNorm statistics: float ones weighted
like the pseudo-gradient, integer ones from the quorum's first group).

A sync is not applied here until torchft's ``should_commit`` says every group got
through it: :meth:`GroupDiLoCo.quorum_sum` only sums, :meth:`GroupDiLoCo.apply`
steps the outer optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

from ..engine.local.diloco import DiLoCo, as_items
from ..engine.transport import comm
from .shares import even_counts


@dataclass
class OuterSums:
    """What one sync's sum over the quorum gave (meaningless when the manager errored)."""

    flat: torch.Tensor  # the summed, item-weighted pseudo-gradient
    buffers: torch.Tensor  # the summed float buffers (weighted), then integer buffers
    weights: list[float]  # each group's weight (items since its last sync), by group index
    members: list[int]  # the groups whose contributions the sum holds
    sent_bytes: int  # this rank's cross-group traffic, a ring all-reduce's 2(Q-1)/Q per byte

    @property
    def total(self) -> float:
        return float(sum(self.weights))


class GroupDiLoCo(DiLoCo):
    """DiLoCo whose workers are replica groups; the loop syncs it through the quorum.

    :meth:`step` only counts the items of an inner step (the sync is the loop's,
    because it needs a quorum, may heal this group, and may have to be summed again);
    :meth:`sync_now` does nothing for the same reason. Its state is a plain
    DiLoCo's (``kind`` "DiLoCo"), so a checkpoint holds the global copy, the outer
    and inner optimizer state and the items since the last sync.
    """

    def step(self, num_items=None) -> None:
        n = as_items(num_items)
        self._steps += 1
        for f in self.fragments:
            f.items += n

    def sync_now(self) -> None:
        """The loop takes the last sync too (``train/ft_local.py``)."""

    def forget(self) -> None:
        """After healing: nothing trained here since the last sync, and the replica is the
        global copy (a joining group starts its inner steps from it)."""
        with torch.no_grad():
            for f in self.fragments:
                f.items = 0.0
                for p, a in zip(f.params, f.anchors):
                    p.copy_(a)

    def _pack(self, weight: float) -> torch.Tensor:
        """weight x (global copy - replica), flat, as ``Fragment.pack`` computes it."""
        parts = []
        for f in self.fragments:
            f_items, f.items = f.items, weight
            parts.append(f.pack())
            f.items = f_items
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _buffer_header(self, weight: float, first: bool) -> list[torch.Tensor]:
        out = [b.detach().reshape(-1).to(torch.float64) * weight for b in self._float_buffers]
        out += [b.detach().reshape(-1).to(torch.float64) * float(first)
                for b in self._other_buffers]
        return out

    def quorum_sum(self, manager, rank: int, world: int, group: int, groups: int,
                   position: int, contribute: bool) -> OuterSums:
        """Sum this group's weighted pseudo-gradient and buffers over the quorum (no update).

        ``contribute``: False for a group that has no work of its own in this sum (it
        has just healed, or it is joining): weight 0. Every rank of the group calls
        the same collectives, whatever its own cross-group link saw.
        """
        mine_items = self.fragments[0].items if contribute else 0.0
        device = self.fragments[0].params[0].device
        local = torch.tensor([mine_items], dtype=torch.float64, device=device)
        comm.all_reduce(local, tag="ft_diloco_items")  # the group's items since the last sync
        weight = float(local[0])
        flat = self._pack(weight)
        header = torch.cat([torch.zeros(2 * groups, dtype=torch.float64, device=device)]
                           + (self._buffer_header(weight, position == 0)
                              if self.sync_buffers else []))
        header[group] = weight
        header[groups + group] = 1.0
        counts = even_counts(flat.numel(), world)
        start = sum(counts[:rank])
        chunk = flat[start:start + counts[rank]].clone()
        works = [manager.allreduce(header, reduce_op=ReduceOp.SUM)]
        if chunk.numel():
            works.append(manager.allreduce(chunk, reduce_op=ReduceOp.SUM))
        for w in works:
            w.wait()
        flat = _gather_chunks(chunk, counts) if world > 1 else chunk
        weights = [float(x) for x in header[:groups]]
        members = [g for g in range(groups) if header[groups + g] > 0.5]
        q = max(len(members), 1)
        wire = chunk.numel() * chunk.element_size() + header.numel() * header.element_size()
        return OuterSums(flat, header[2 * groups:], weights, members,
                         int(2 * (q - 1) / q * wire))

    def apply(self, sums: OuterSums) -> None:
        """The outer step on the quorum's sum / the weights present; every parameter from
        the new global copy (no outer step when nobody brought any work: a fresh start)."""
        total = sums.total
        at = 0
        for f in self.fragments:
            f.apply(sums.flat[at:at + f.numel], total, self.outer_optimizer, alpha=0.0)
            f.items, f.last_sent = 0.0, self._steps
            at += f.numel
        if self.sync_buffers and total > 0:
            self._set_buffers(sums.buffers, total)
        self._count(sums.sent_bytes, sums.sent_bytes)

    def _set_buffers(self, summed: torch.Tensor, total: float) -> None:
        at = 0
        with torch.no_grad():
            for b in self._float_buffers:
                b.copy_((summed[at:at + b.numel()] / total).view_as(b))
                at += b.numel()
            for b in self._other_buffers:
                b.copy_(summed[at:at + b.numel()].round().view_as(b))
                at += b.numel()


def _gather_chunks(chunk: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's summed chunk, concatenated (chunks differ by at most one: padded)."""
    width = max(counts)
    padded = torch.zeros(width, dtype=chunk.dtype, device=chunk.device)
    padded[:chunk.numel()] = chunk
    out = torch.empty(width * len(counts), dtype=chunk.dtype, device=chunk.device)
    comm.all_gather_single(out, padded, tag="ft_diloco_chunks")
    return torch.cat([out[k * width:k * width + c] for k, c in enumerate(counts)])
