"""How a sharded strategy moves a flat buffer: chosen per backend from measurements.

ZeRO (arXiv 1910.02054, section 7) counts volume: a reduce-scatter and an
all-gather each move about Psi, half of an all-reduce's 2 Psi. Wall-clock cost
depends on how the backend implements them. Measured on this project's machine
(2 CPU cores, gloo over loopback, torch 2.13; ms, best of 3 alternating medians of
7; ``benchmarks/collectives.py``, and ``--world 3`` / ``--world 4``):

    ranks  MB   all_reduce  gloo RS  pairwise RS   gloo AG  all_reduce AG  pairwise AG
      2     1      0.79       1.59      0.35         0.69       1.00          0.33
      2   4.2      2.63       4.71      1.77         2.37       4.00          1.57
      2     8      5.85       7.59      5.25         5.71       7.35          2.73
      2  33.6     19.18      29.64     16.11        43.33      26.92         15.93
      3     8      7.69      13.25      5.76         8.08      10.95          4.71
      4     8     12.36      14.81      5.61         9.81      13.88          6.00
      4  33.6     44.03      67.57     29.88        60.29      50.21         23.32

gloo's reduce-scatter costs more than an all-reduce of the same tensor, and its
all-gather is no better than an all-reduce above a few MB. Posting the data
movement directly as point-to-point messages ("pairwise": rank r sends slice j of
its buffer to rank j and receives N-1 copies of slice r, which it sums in rank
order; for a gather it sends its shard to every peer and receives theirs straight
into place) moves exactly the textbook (N-1)/N of the buffer per rank and beats
both at every size measured, so gloo uses it for both directions. The sum is in
rank order on the owning rank, so the result does not depend on message timing.
N-1 concurrent messages per rank is an all-to-all pattern: right for the small
worlds gloo serves; NCCL implements the ring collectives natively, so it uses
``reduce_scatter_single`` and ``all_gather_single``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm
from .algorithms import hierarchical
from .algorithms.topology import host_topology
from .comm_thread import CommThread

REDUCE_OPS = ("reduce_scatter", "all_reduce", "pairwise", "hierarchical")
GATHER_OPS = ("all_gather", "all_reduce", "pairwise", "hierarchical")
CHOICES = {"native": ("reduce_scatter", "all_gather"),
           "all_reduce": ("all_reduce", "all_reduce"),
           "pairwise": ("pairwise", "pairwise"),
           "hierarchical": ("hierarchical", "hierarchical")}
_TAG_SPACE = 1 << 24  # gloo point-to-point tags; messages of one operation share one


@dataclass(frozen=True)
class ShardComm:
    """Which collective implements a shard reduction and a shard gather.

    reduce_op: ``"reduce_scatter"``, ``"all_reduce"`` (then slice) or ``"pairwise"``.
    gather_op: ``"all_gather"``, ``"all_reduce"`` (of a zero-filled buffer holding
        this rank's shard; x + 0 is exact) or ``"pairwise"``.
    """

    reduce_op: str = "reduce_scatter"
    gather_op: str = "all_gather"
    _tags: dict = field(default_factory=dict, compare=False, repr=False)
    topology: object = field(default=None, compare=False, repr=False)  # for "hierarchical"
    _thread: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}")
        if self.gather_op not in GATHER_OPS:
            raise ValueError(f"gather_op must be one of {GATHER_OPS}, got {self.gather_op!r}")

    @staticmethod
    def for_group(group=None, choice: str = "auto", topology=None) -> ShardComm:
        """``choice``: ``"auto"`` (per backend, as measured), ``"native"``,
        ``"all_reduce"``, ``"pairwise"`` or ``"hierarchical"`` (two-level reduce-scatter
        and all-gather over ``topology``, default torchrun's hosts, on a communication
        thread: for hosts joined by a slow link)."""
        if choice == "auto":
            choice = "pairwise" if dist.get_backend(group) == "gloo" else "native"
        if choice not in CHOICES:
            raise ValueError("collectives must be 'auto', " + ", ".join(map(repr, CHOICES))
                             + f", got {choice!r}")
        if choice == "hierarchical":
            if group is not None:
                raise ValueError("collectives='hierarchical' shards over the default group")
            return ShardComm(*CHOICES[choice], topology=host_topology(topology),
                             _thread=CommThread("gradsync-zero"))
        return ShardComm(*CHOICES[choice])

    def _p2p_tag(self, group) -> int:
        """The next point-to-point tag on ``group``: every rank issues the same sequence
        of operations per group, so the counters agree without communication."""
        counter = self._tags.setdefault(id(group), itertools.count())
        return next(counter) % _TAG_SPACE

    def reduce(self, full: torch.Tensor, rank: int, world: int, group, tag: str
               ) -> tuple[comm.Pending, torch.Tensor]:
        """Launch the sum of ``full`` over ranks; returns (pending, this rank's slice).

        The slice is valid once ``pending.wait()`` returned. ``full`` may be
        overwritten (the all-reduce and pairwise paths work in place).
        """
        n = full.numel() // world
        if self.reduce_op == "hierarchical":
            out = torch.empty(n, dtype=full.dtype, device=full.device)
            return self._thread.submit(hierarchical.reduce_scatter, out, full, self.topology,
                                       tag=tag), out
        if self.reduce_op == "all_reduce":
            pending = comm.all_reduce(full, group, async_op=True, tag=tag)
            return pending, full[rank * n:(rank + 1) * n]
        if self.reduce_op == "pairwise":
            return self._pairwise_reduce(full, rank, world, n, group, tag)
        out = torch.empty(n, dtype=full.dtype, device=full.device)
        pending = comm.reduce_scatter_single(out, full, group, async_op=True, tag=tag)
        return pending, out

    def _pairwise_reduce(self, full, rank, world, n, group, tag):
        mine = full[rank * n:(rank + 1) * n]
        peers = [j for j in range(world) if j != rank]
        received = {j: torch.empty_like(mine) for j in peers}

        def finish():  # sum in rank order: c0 + c1 + ... whichever rank owns the slice
            parts = [mine if j == rank else received[j] for j in range(world)]
            if len(parts) == 1:
                return
            total = parts[0] + parts[1]
            for p in parts[2:]:
                total.add_(p)
            mine.copy_(total)

        pending = comm.exchange(
            "reduce_scatter", full, sends=[(full[j * n:(j + 1) * n], j) for j in peers],
            recvs=[(received[j], j) for j in peers], group=group,
            p2p_tag=self._p2p_tag(group), finish=finish, async_op=True, tag=tag,
            meta={"algorithm": "pairwise"})
        return pending, mine

    def gather(self, full: torch.Tensor, shard: torch.Tensor, rank: int, group, tag: str
               ) -> comm.Pending:
        """Launch filling ``full`` with every rank's ``shard`` (rank-major).

        ``shard`` is read during this call only (copied, in ``full``'s dtype, into
        this rank's slice of ``full``, which is what is sent), so the caller may change
        it at once; it may be that slice itself.
        """
        n = shard.numel()
        if self.gather_op == "hierarchical":  # a copy: the caller may change ``shard`` at once
            return self._thread.submit(hierarchical.all_gather, full, shard.to(full.dtype,
                                       copy=True), self.topology, tag=tag)
        mine = full[rank * n:(rank + 1) * n]
        if self.gather_op == "all_reduce":
            if mine.data_ptr() == shard.data_ptr():
                shard = shard.clone()
            full.zero_()
            mine.copy_(shard)
            return comm.all_reduce(full, group, async_op=True, tag=tag)
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        if self.gather_op == "pairwise":
            peers = [j for j in range(full.numel() // n) if j != rank] if n else []
            return comm.exchange(
                "all_gather", full, sends=[(mine, j) for j in peers],
                recvs=[(full[j * n:(j + 1) * n], j) for j in peers], group=group,
                p2p_tag=self._p2p_tag(group), async_op=True, tag=tag,
                meta={"algorithm": "pairwise"})
        # NCCL documents the in-place form (input = this rank's slice of the output)
        src = mine if full.is_cuda else mine.clone()
        return comm.all_gather_single(full, src, group, async_op=True, tag=tag)
