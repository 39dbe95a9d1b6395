"""DataParallel buckets summed by a reference algorithm: ring, tree, parameter server or
hierarchical (two-level) all-reduce, on a communication thread.

Why: between hosts the link is the bottleneck, and a flat ring sends every
rank's share across it. The hierarchical all-reduce (reduce-scatter inside a
host, all-reduce of one piece per local rank across hosts, all-gather inside the
host; the two-level scheme of Horovod and of NCCL's tree/ring hierarchy, see
arXiv 1802.05799) moves 1/g of the bytes over the slow link per rank, which on two
emulated hosts of two ranks at 100 Mbit/s measured 413 ms against a flat ring's
569 ms for 4 MB (``docs/netlab.md``).

The algorithms block, so a bucket is handed to a
:class:`~gradsync.engine.transport.comm_thread.CommThread` and overlaps the rest
of backward like an async all-reduce. Their sums run in a fixed order, so every
rank holds bitwise the same gradient and the small integer slots (item header,
used mask) may still ride in the buckets. Everything else --
hooks, launch order, ``num_items``, the DDP-compatibility rules -- is
DataParallel's.
"""

from __future__ import annotations

import functools

import torch

from ...errors import UsageError
from ..transport.algorithms import ALGORITHMS, HostTopology, hierarchical
from ..transport.algorithms.topology import host_topology
from ..transport.comm_thread import CommThread, private_group
from .reduction import AllReduceBuckets

BUCKET_ALGORITHMS = ("ring", "tree", "server", "hierarchical")



class AlgorithmBuckets(AllReduceBuckets):
    """Sum each bucket with ``algorithm`` on a communication thread.

    topology: for ``"hierarchical"`` (default: from torchrun's environment); its
        process groups then belong to this reduction's thread.
    """

    exact_sum = True

    def __init__(self, algorithm: str = "hierarchical", topology: HostTopology | None = None,
                 reduce_dtype: torch.dtype | None = None):
        if algorithm not in BUCKET_ALGORITHMS:
            raise UsageError(f"collectives must be 'native' or one of "
                             f"{', '.join(BUCKET_ALGORITHMS)}, got {algorithm!r}")
        super().__init__(reduce_dtype)
        self.algorithm, self.topology = algorithm, topology
        self._thread = CommThread(f"gradsync-{algorithm}")
        self._fn = None

    def attach(self, dp) -> None:
        super().attach(dp)
        if self._fn is not None:
            return
        if self.algorithm == "hierarchical":
            self.topology = host_topology(self.topology)
            self._fn = functools.partial(hierarchical.all_reduce_, topology=self.topology)
        else:
            self._fn = functools.partial(ALGORITHMS[self.algorithm], group=private_group(dp.group))

    def communicate(self, bucket, src):
        return self._thread.submit(self._fn, src, tag=f"bucket{bucket.spec.index}")

    def close(self) -> None:
        self._thread.close()
