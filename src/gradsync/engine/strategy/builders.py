"""Building the strategies of ``local_strategy.py`` from :class:`SyncOptions`.

Kept apart from ``strategy.py`` so the exact strategies' module does not grow with
every way of spending exactness.
"""

from __future__ import annotations

import torch

from ...errors import UsageError
from ..compress import CompressedBuckets, parse_compression
from ..local.diloco import DiLoCo
from ..local.streaming import StreamingDiLoCo
from ..transport.algorithms.topology import HostTopology
from .inexact import HostModel, LocalModel, LocalUpdateStrategy
from .options import SyncOptions


def compressed_reduction(sync: SyncOptions, mp) -> CompressedBuckets:
    """DataParallel's buckets through ``--compress`` (sums in fp32 for a bf16 model)."""
    return CompressedBuckets(parse_compression(sync.compress), probe_every=sync.probe_every,
                             reduce_dtype=mp.reduce_dtype if mp is not None else None)


def outer_sgd(lr: float, momentum: float):
    """DiLoCo's outer optimizer (arXiv 2311.08105, section 3: SGD, Nesterov momentum 0.9);
    lr 1 and no momentum make it Local SGD."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum,
                                          nesterov=momentum > 0)


def build_local(module, precision, optimizer_class, group, sync: SyncOptions,
                bucket_cap_mb: float = 25.0, **opt_kwargs):
    """``--sync diloco|streaming-diloco``: a local replica, its inner optimizer, DiLoCo.

    With ``--collectives hierarchical`` a worker is a host (torchrun's layout): exact
    data parallelism inside it, DiLoCo across hosts, pseudo-gradients two-level.
    """
    sync.check_precision(precision)
    topology = None
    if sync.collectives == "hierarchical":
        if group is not None:
            raise UsageError("a DiLoCo worker per host spans the world: no process group")
        topology = HostTopology.from_env()
        model = HostModel(module, topology.intra_group, float(bucket_cap_mb))
    else:
        model = LocalModel(module)
    inner = optimizer_class(module.parameters(), **opt_kwargs)
    compress = None if sync.compress == "none" else sync.compress
    if sync.method == "diloco":
        diloco = DiLoCo(module, inner, outer_sgd(sync.outer_lr, sync.outer_momentum),
                        sync_every=sync.every, group=group, compress=compress,
                        topology=topology)
    else:
        diloco = StreamingDiLoCo(module, inner, outer_sgd(sync.outer_lr, sync.outer_momentum),
                                 sync_every=sync.every, fragments=sync.fragments,
                                 delay=sync.delay, alpha=sync.alpha, group=group,
                                 compress=compress, topology=topology)
    return LocalUpdateStrategy(sync.method, precision, model, inner, diloco)
