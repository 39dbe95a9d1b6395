"""Which ranks share a host, and the two kinds of process group a two-level collective uses.

A hierarchical collective talks over two networks: the fast one inside a host
(loopback or NVLink) and the slow one between hosts. ``HostTopology`` records the
host of every rank and creates

* one **intra-host** group per host (its g ranks), and
* one **inter-host** group per local index l (rank l of every host),

so ``H`` hosts of ``g`` ranks give ``H`` intra groups of size g and ``g`` inter
groups of size H. Ranks of one host must be contiguous global ranks (torchrun
assigns them so: rank = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK), which makes
host h's ranks ``h*g .. h*g+g-1``, intra-group rank l and inter-group rank h.

``torch.distributed.new_group`` is collective over the whole world: every rank
creates every subgroup, in the same order, whichever groups it belongs to. Both
constructors do exactly that, so build a ``HostTopology`` on every rank at the
same point of the program (after ``gs.init()``), once, and reuse it.

Only the default (world) group is supported as the parent.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ....dist import comm_device, default_timeout_s
from ....errors import UsageError
from .. import comm, host


class HostTopology:
    """Hosts of ``ranks_per_host`` contiguous ranks and their process groups.

    ``HostTopology(ranks_per_host=2)``: explicit (e.g. two emulated hosts of two
    ranks inside one ``gs.spawn`` of 4). ``HostTopology.from_env()``: from torchrun's
    ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``, checked across ranks.

    Attributes: ``world_size``, ``rank``, ``ranks_per_host`` (g), ``num_hosts`` (H),
    ``host`` (this rank's host index), ``local_rank`` (index within the host),
    ``intra_group`` (this host's ranks), ``inter_group`` (local rank ``local_rank`` of
    every host), ``host_ranks`` (global ranks per host).
    """

    def __init__(self, ranks_per_host: int, *, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise UsageError("HostTopology needs an initialised process group (gs.init())")
        world = dist.get_world_size()
        if (not isinstance(ranks_per_host, int) or isinstance(ranks_per_host, bool)
                or ranks_per_host < 1 or world % ranks_per_host):
            raise UsageError(f"HostTopology: ranks_per_host={ranks_per_host!r} must be a "
                             f"positive divisor of the world size {world}")
        g = ranks_per_host
        self.world_size, self.rank, self.ranks_per_host = world, dist.get_rank(), g
        self.num_hosts = world // g
        self.host, self.local_rank = divmod(self.rank, g)
        self.host_ranks = tuple(tuple(range(h * g, (h + 1) * g)) for h in range(self.num_hosts))
        if timeout_s is None:
            timeout_s = default_timeout_s()
        timeout = timedelta(seconds=timeout_s)
        self._groups = []
        for ranks in self.host_ranks:  # every rank creates every group, in this order
            grp = dist.new_group(list(ranks), timeout=timeout)
            self._groups.append(grp)
            if self.rank in ranks:
                self.intra_group = grp
        for j in range(g):
            ranks = [h * g + j for h in range(self.num_hosts)]
            grp = dist.new_group(ranks, timeout=timeout)
            self._groups.append(grp)
            if self.rank in ranks:
                self.inter_group = grp
        for grp in (self.intra_group, self.inter_group):  # NCCL: see comm_thread.open_group
            comm.all_reduce(torch.zeros(1, device=comm_device(grp)), grp, tag="open-group")

    @classmethod
    def from_env(cls, *, timeout_s: float | None = None) -> HostTopology:
        """Hosts as torchrun laid them out (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``).

        One all-gather of (GROUP_RANK, LOCAL_WORLD_SIZE) per rank checks that every
        host runs the same number of ranks, contiguously; every rank sees the same
        table, so a bad layout is the same one-line error on every rank, not a hang.
        """
        try:
            mine = [int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])]
        except (KeyError, ValueError):
            raise UsageError("HostTopology.from_env: GROUP_RANK and LOCAL_WORLD_SIZE must be "
                             "set (launch with torchrun or gs.spawn)") from None
        world = dist.get_world_size()
        dev = comm_device()  # NCCL moves device tensors only
        everyone = torch.empty(2 * world, dtype=torch.int64, device=dev)
        comm.all_gather_single(everyone, torch.tensor(mine, dtype=torch.int64, device=dev),
                               tag="topology")
        # the emulated accelerator moves no values: this rank's layout stands in for all
        like_mine = [v for r in range(world) for v in (r // mine[1], mine[1])]
        table = host.read(everyone, emulated=torch.tensor(like_mine)).view(world, 2)
        hosts = table[:, 0].tolist()
        sizes = set(table[:, 1].tolist())
        g = sizes.pop()
        if sizes or world % g:
            raise UsageError("HostTopology: hosts run different numbers of ranks "
                             f"(LOCAL_WORLD_SIZE per rank: {table[:, 1].tolist()})")
        expected = [r // g for r in range(world)]
        if hosts != expected:
            raise UsageError(f"HostTopology: ranks of a host are not contiguous "
                             f"(GROUP_RANK per rank: {hosts})")
        return cls(g, timeout_s=timeout_s)

    def close(self) -> None:
        """Destroy the subgroups (all ranks, same point); the topology is unusable after."""
        for grp in self._groups:
            dist.destroy_process_group(grp)
        self._groups = []

    def __repr__(self) -> str:
        return (f"HostTopology(hosts={self.num_hosts}, ranks_per_host={self.ranks_per_host}, "
                f"rank={self.rank}, host={self.host}, local_rank={self.local_rank})")


def hosts_in_env(env) -> tuple[int, int] | None:
    """(hosts, ranks per host) as torchrun describes the job in ``env``, without talking.

    torchrun sets ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (ranks on this host) and
    ``GROUP_WORLD_SIZE`` (hosts, one agent each) in every worker. None when they are
    missing or malformed, or when the hosts run different numbers of ranks: then
    ``WORLD_SIZE != GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE`` on some host, and on every
    host as soon as two sizes differ, so every rank reaches the same answer from its
    own environment and a choice made on it needs no collective (``from_env`` checks
    the layout again, with one, when the groups are built).
    """
    try:
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        hosts = int(env.get("GROUP_WORLD_SIZE", world // local if local > 0 else 0))
    except (KeyError, ValueError, TypeError):
        return None
    if world < 1 or local < 1 or hosts < 1 or hosts * local != world:
        return None
    return hosts, local


def host_topology(topology: HostTopology | None) -> HostTopology:
    """``topology``, or the hosts torchrun laid out (every rank calls this at once)."""
    return topology if topology is not None else HostTopology.from_env()
