"""DiLoCo across replica groups: a group is one DiLoCo worker, its sync goes through the quorum.

The DiLoCo paper's workers are islands of accelerators that train synchronously
inside and exchange only pseudo-gradients between them (arXiv 2311.08105). Here
an island is a replica group: its ranks run gradsync's exact ddp for the inner
steps, and only the outer syncs cross between groups, through torchft's
``Manager.allreduce`` over the quorum taken when the sync is due
(``ft/local_groups.py`` decides when, and what a sync that does not commit does).

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
steps the outer optimizer. :class:`GroupStreamingDiLoCo` sums only the fragments
due, each with its own weight, and keeps each sum aside until the plain run would
have applied it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

from ..engine.local.diloco import DiLoCo
from ..engine.local.exchange import as_items
from ..engine.local.streaming import StreamingDiLoCo
from ..engine.transport import comm
from .shares import even_counts


@dataclass
class OuterSums:
    """What one sync's sum over the quorum gave (meaningless when the manager errored)."""

    flat: torch.Tensor  # the summed, item-weighted pseudo-gradients of ``fragments``, in order
    buffers: torch.Tensor  # the summed float buffers (weighted), then integer buffers
    by_fragment: list[list[float]]  # per synced fragment, each group's weight by group index
    members: list[int]  # the groups whose contributions the sum holds
    sent_bytes: int  # this rank's cross-group traffic, a ring all-reduce's 2(Q-1)/Q per byte
    fragments: list[int]  # the fragments this sum holds (DiLoCo: its one, [0])

    @property
    def weights(self) -> list:
        """For the sync's metrics line: by group; by fragment, then group, when several."""
        return self.by_fragment[0] if len(self.by_fragment) == 1 else self.by_fragment

    def total(self, k: int = 0) -> float:
        return float(sum(self.by_fragment[k])) if self.by_fragment else 0.0


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
        """The loop takes the last sync too (``ft/local_groups.py``)."""

    def forget(self) -> None:
        """After healing: nothing trained here since the last sync, and the replica is the
        global copy (a joining group starts its inner steps from it)."""
        with torch.no_grad():
            for f in self.fragments:
                f.items = 0.0
                for p, a in zip(f.params, f.anchors):
                    p.copy_(a)

    def due(self, step: int, last: bool, joining: bool = False) -> list[int]:
        """The fragments summed at the sync after step ``step`` (none: no sync). DiLoCo
        sums its one fragment every H steps, at the last step and when joining."""
        return [0] if joining or last or step % self.sync_every == 0 else []

    def settle(self) -> None:
        """Before the last sync: nothing to do (streaming applies its pending results)."""

    def _pack(self, frags, weights: list[float]) -> torch.Tensor:
        """weight x (global copy - replica) per fragment, flat, as ``Fragment.pack``."""
        parts = []
        for f, weight in zip(frags, weights):
            f_items, f.items = f.items, weight
            parts.append(f.pack())
            f.items = f_items
        if not parts:
            return torch.empty(0, dtype=torch.float64, device=self.fragments[0].anchors[0].device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _buffer_header(self, weight: float, first: bool) -> list[torch.Tensor]:
        out = [b.detach().reshape(-1).to(torch.float64) * weight for b in self._float_buffers]
        out += [b.detach().reshape(-1).to(torch.float64) * float(first)
                for b in self._other_buffers]
        return out

    def quorum_sum(self, manager, rank: int, world: int, group: int, groups: int,
                   position: int, contribute: bool, fragments=(0,)) -> OuterSums:
        """Sum this group's weighted pseudo-gradients of ``fragments`` and the buffers (with
        fragment 0) over the quorum (no update).

        ``contribute``: False for a group that has no work of its own in this sum (it
        has just healed, or it is joining): weight 0. Every rank of the group calls
        the same collectives, whatever its own cross-group link saw. Each fragment has
        its own weight: the items since it was last summed (streaming staggers them).
        """
        frags = [self.fragments[i] for i in fragments]
        nf = len(frags)
        device = self.fragments[0].params[0].device
        weights = [0.0] * nf
        if nf:
            local = torch.tensor([f.items if contribute else 0.0 for f in frags],
                                 dtype=torch.float64, device=device)
            comm.all_reduce(local, tag="ft_diloco_items")  # the group's items per fragment
            weights = [float(x) for x in local]
        flat = self._pack(frags, weights)
        with_buffers = self.sync_buffers and 0 in fragments
        header = torch.cat([torch.zeros((nf + 1) * groups, dtype=torch.float64, device=device)]
                           + (self._buffer_header(weights[list(fragments).index(0)],
                                                  position == 0) if with_buffers else []))
        for k, w in enumerate(weights):
            header[k * groups + group] = w
        header[nf * groups + group] = 1.0
        counts = even_counts(flat.numel(), world)
        start = sum(counts[:rank])
        chunk = flat[start:start + counts[rank]].clone()
        works = [manager.allreduce(header, reduce_op=ReduceOp.SUM)]
        if chunk.numel():
            works.append(manager.allreduce(chunk, reduce_op=ReduceOp.SUM))
        for w in works:
            w.wait()
        flat = _gather_chunks(chunk, counts) if world > 1 and flat.numel() else chunk
        by_fragment = [[float(x) for x in header[k * groups:(k + 1) * groups]]
                       for k in range(nf)]
        members = [g for g in range(groups) if header[nf * groups + g] > 0.5]
        q = max(len(members), 1)
        wire = chunk.numel() * chunk.element_size() + header.numel() * header.element_size()
        return OuterSums(flat, header[(nf + 1) * groups:], by_fragment, members,
                         int(2 * (q - 1) / q * wire), list(fragments))

    def apply(self, sums: OuterSums, last: bool = False) -> None:
        """The outer step on the quorum's sum / the weights present; every parameter from
        the new global copy (no outer step when nobody brought any work: a fresh start)."""
        total = sums.total()
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


class GroupStreamingDiLoCo(GroupDiLoCo, StreamingDiLoCo):
    """Streaming DiLoCo whose workers are replica groups (``--sync streaming-diloco``).

    The plain run's schedule, unchanged: fragment f is summed after the steps ``s``
    with ``(s - f H // F) % H == 0``, its result applied after step ``s + tau`` and
    merged with alpha; the last step applies what is pending, then sums every
    fragment and takes the global copy. What differs is when the sum happens: the
    plain run reduces on a thread while the next tau steps go on; here the quorum
    sums synchronously at the sync step (it has to: the quorum, a heal or a sum that
    does not commit are decided there) and the result waits, held
    (:meth:`StreamingDiLoCo.hold`), until its step. The inner steps in between do not read it, so
    the trajectory is the plain run's (tested bitwise); only the overlap is lost.
    Pending results are in ``state_dict`` (StreamingDiLoCo's own), so a checkpoint
    and a healing group get them.
    """

    def step(self, num_items=None) -> None:
        """Count the items and apply the results due now; the loop takes the sums."""
        GroupDiLoCo.step(self, num_items)
        for job in [j for j in self._inflight if j.due <= self._steps]:
            self._finish(job, self.alpha)

    def due(self, step: int, last: bool, joining: bool = False) -> list[int]:
        if joining:  # (re)starting at a checkpoint: its sync is behind it
            return []
        if last:
            return list(range(len(self.fragments)))
        return [f for f, off in enumerate(self.offsets) if (step - off) % self.sync_every == 0]

    def settle(self) -> None:
        """Before the last sum: apply what is pending, merged with alpha (``sync_now``)."""
        for job in list(self._inflight):
            self._finish(job, self.alpha)

    def apply(self, sums: OuterSums, last: bool = False) -> None:
        """The last sync: outer step and the global copy at once (alpha 0); before it: keep
        each fragment's sum aside until step + tau (at once when tau is 0)."""
        at, jobs = 0, []
        for k, i in enumerate(sums.fragments):
            f = self.fragments[i]
            part, total = sums.flat[at:at + f.numel], sums.total(k)
            at += f.numel
            f.items, f.last_sent = 0.0, self._steps
            if last:
                f.apply(part, total, self.outer_optimizer, alpha=0.0)
            else:
                sent = sums.sent_bytes if k == 0 else 0  # the sync's bytes, counted once
                jobs.append(self.hold(i, (part.clone(), total, sent, sent)))
        if self.sync_buffers and 0 in sums.fragments:
            total = sums.total(sums.fragments.index(0))
            if total > 0:
                self._set_buffers(sums.buffers, total)
        if last and sums.fragments:
            self._count(sums.sent_bytes, sums.sent_bytes)
        for job in jobs if self.delay == 0 else []:
            self._finish(job, self.alpha)


def _gather_chunks(chunk: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's summed chunk, concatenated (chunks differ by at most one: padded)."""
    width = max(counts)
    padded = torch.zeros(width, dtype=chunk.dtype, device=chunk.device)
    padded[:chunk.numel()] = chunk
    out = torch.empty(width * len(counts), dtype=chunk.dtype, device=chunk.device)
    comm.all_gather_single(out, padded, tag="ft_diloco_chunks")
    return torch.cat([out[k * width:k * width + c] for k, c in enumerate(counts)])
