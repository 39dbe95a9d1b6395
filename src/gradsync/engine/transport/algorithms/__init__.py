"""Reference all-reduce algorithms on point-to-point messages, and two-level topologies.

Every algorithm is blocking and in place, with one signature::

    ring.all_reduce_(tensor, group=None, *, tag="ring")
    tree.all_reduce_(tensor, group=None, *, tag="tree")
    server.all_reduce_(tensor, group=None, *, tag="server", root=0)
    hierarchical.all_reduce_(tensor, topology, *, tag="hierarchical", inter=ring.all_reduce_)
    hierarchical.reduce_scatter(output, input, topology, *, tag="hierarchical")
    hierarchical.all_gather(output, input, topology, *, tag="hierarchical")

built from rounds of ``transport.comm.exchange`` (isend/irecv), each observed as
one collective through ``comm.composite``. Each sums in a fixed order, so every
rank holds bitwise the same result. They are safe to call from a dedicated
communication thread (one operation per group at a time, the same sequence on
every rank). ``plan.two_level`` prices the same message schedules with measured
intra- and inter-host alpha/beta.
"""

from . import hierarchical, ring, server, tree
from .topology import HostTopology

ALGORITHMS = {"ring": ring.all_reduce_, "tree": tree.all_reduce_, "server": server.all_reduce_}

__all__ = ["ALGORITHMS", "HostTopology", "hierarchical", "ring", "server", "tree"]
