"""The builders behind ``--strategy`` names: a module in, a :class:`Strategy` out.

``_ddp`` covers every ``--sync``/``--compress`` mode (exact, compressed buckets,
DiLoCo's local updates); ``zero1``-``zero3`` synchronise exactly only and say so
naming the flag. The registry (``registry.py``) maps names to these. Each builder
decides ``--collectives auto`` first (``SyncOptions.resolved``), so the model it
returns records what was chosen (``model.collectives``).
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import UsageError
from ..compress import CompressedBuckets, HostCompressedBuckets, parse_compression
from ..local.diloco import DiLoCo
from ..local.streaming import StreamingDiLoCo
from ..replicated.data_parallel import DataParallel
from ..replicated.mixed_optimizer import MixedPrecisionOptimizer
from ..replicated.precision import parse_precision
from ..sharded.fsdp.wrapper import FullyShardedDataParallel
from ..sharded.zero import ZeroOptimizer
from ..sync.param_groups import module_param_groups
from ..sync.replicas import check_module_device
from ..transport.algorithms.topology import HostTopology
from .exact import DataParallelStrategy, FullyShardedStrategy, ZeroStrategy, default_wrap
from .inexact import CompressedStrategy, HostModel, LocalModel, LocalUpdateStrategy
from .options import SyncOptions


def compressed_reduction(sync: SyncOptions, mp) -> CompressedBuckets:
    """DataParallel's buckets through ``--compress`` (sums in fp32 for a bf16 model); with
    ``--collectives hierarchical`` exact inside each host and compressed across hosts."""
    kw = dict(probe_every=sync.probe_every, delay=sync.compress_delay,
              reduce_dtype=mp.reduce_dtype if mp is not None else None)
    compressor = parse_compression(sync.compress)
    if sync.collectives == "hierarchical":
        return HostCompressedBuckets(compressor, **kw)
    return CompressedBuckets(compressor, **kw)


def _chose(strategy, sync: SyncOptions):
    """Record on ``strategy`` the collectives its sums took (``auto`` decided)."""
    strategy.collectives = sync.collectives
    return strategy


def outer_sgd(lr: float, momentum: float):
    """DiLoCo's outer optimizer (arXiv 2311.08105, section 3: SGD, Nesterov momentum 0.9);
    lr 1 and no momentum make it Local SGD."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum,
                                          nesterov=momentum > 0)


def _whole(module, param_groups, what: str):
    """What an optimizer of whole parameters is built on: ``module``'s parameters, in the
    named groups when given (``sync/param_groups.py``)."""
    if param_groups is None:
        return module.parameters()
    return module_param_groups(module, param_groups, what)


def build_local(module, precision, optimizer_class, group, sync: SyncOptions,
                bucket_cap_mb: float = 25.0, outer_sync=None, param_groups=None, **opt_kwargs):
    """``--sync diloco|streaming-diloco``: a local replica, its inner optimizer, DiLoCo.

    With ``--collectives hierarchical`` a worker is a host (torchrun's layout): exact
    data parallelism inside it, DiLoCo across hosts, pseudo-gradients two-level. With
    ``outer_sync`` the whole process group is one worker (exact inside it) and
    ``outer_sync(module, inner, outer_optimizer, sync)`` makes its DiLoCo, whose syncs
    the caller takes (``build_strategy``).
    """
    sync.check_precision(precision)
    check_module_device(module, group, f"--sync {sync.method}")
    sync = sync.resolved(group)
    if outer_sync is not None:
        model = HostModel(module, group, float(bucket_cap_mb))
        inner = optimizer_class(_whole(module, param_groups, f"--sync {sync.method}"),
                                **opt_kwargs)
        diloco = outer_sync(module, inner, outer_sgd(sync.outer_lr, sync.outer_momentum), sync)
        return _chose(LocalUpdateStrategy(sync.method, precision, model, inner, diloco), sync)
    topology = None
    if sync.collectives == "hierarchical":
        if group is not None:
            raise UsageError("a DiLoCo worker per host spans the world: no process group")
        topology = HostTopology.from_env()
        model = HostModel(module, topology.intra_group, float(bucket_cap_mb))
    else:
        model = LocalModel(module)
    inner = optimizer_class(_whole(module, param_groups, f"--sync {sync.method}"), **opt_kwargs)
    compress = None if sync.compress == "none" else sync.compress
    ramp = dict(warmup_steps=sync.warmup, outer_momentum_warmup=sync.momentum_warmup)
    if sync.method == "diloco":
        diloco = DiLoCo(module, inner, outer_sgd(sync.outer_lr, sync.outer_momentum),
                        sync_every=sync.every, group=group, compress=compress,
                        topology=topology, sync_every_max=sync.every_max, **ramp)
    else:
        diloco = StreamingDiLoCo(module, inner, outer_sgd(sync.outer_lr, sync.outer_momentum),
                                 sync_every=sync.every, fragments=sync.fragments,
                                 delay=sync.delay, alpha=sync.alpha, group=group,
                                 compress=compress, topology=topology, eager=sync.eager, **ramp)
    return _chose(LocalUpdateStrategy(sync.method, precision, model, inner, diloco), sync)


def build_ddp(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
         find_unused_parameters=False, outer_sync=None, param_groups=None, **opt_kwargs):
    sync = sync or SyncOptions()
    sync.check_precision(precision)
    sync = sync.resolved(group)
    if sync.method != "exact":
        bucket_cap = 25.0 if bucket_cap_mb == "auto" else bucket_cap_mb
        return build_local(module, precision, optimizer_class, group, sync, bucket_cap,
                           outer_sync, param_groups, **opt_kwargs)
    if outer_sync is not None:
        raise UsageError("outer_sync is a local-update option: --sync diloco or "
                         "streaming-diloco")
    mp = parse_precision(precision)
    reduction = None
    if sync.compress != "none":
        reduction = compressed_reduction(sync, mp)
    model = DataParallel(module, group=group, bucket_cap_mb=bucket_cap_mb,
                         collectives=sync.collectives, reduction=reduction,
                         find_unused_parameters=find_unused_parameters)
    if mp is not None:
        opt = MixedPrecisionOptimizer(model, optimizer_class, mp, param_groups=param_groups,
                                      **opt_kwargs)
    else:
        opt = optimizer_class(_whole(module, param_groups, "--strategy ddp"), **opt_kwargs)
    if reduction is not None:
        return _chose(CompressedStrategy("ddp", precision, model, opt, reduction), sync)
    return _chose(DataParallelStrategy("ddp", precision, model, opt), sync)


def _exact_only(name: str, sync) -> SyncOptions:
    sync = sync or SyncOptions()
    inexact = [f"--sync {sync.method}"] * (sync.method != "exact") + \
        [f"--compress {sync.compress}"] * (sync.compress != "none")
    if inexact:
        needs = "need" if len(inexact) > 1 else "needs"
        raise UsageError(f"--strategy {name} synchronises exactly: {' and '.join(inexact)} "
                         f"{needs} --strategy ddp")
    return sync


def build_zero(stage: int):
    def build(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
              find_unused_parameters=False, **opt_kwargs):
        sync = _exact_only(f"zero{stage}", sync).resolved(group)
        model = DataParallel(module, group=group, bucket_cap_mb=bucket_cap_mb,
                             collectives=sync.collectives,
                             find_unused_parameters=find_unused_parameters)
        opt = ZeroOptimizer(model, optimizer_class, stage=stage,
                            mixed_precision=parse_precision(precision), **opt_kwargs)
        return _chose(ZeroStrategy(f"zero{stage}", precision, model, opt), sync)
    return build


def build_fsdp(module, precision, optimizer_class, bucket_cap_mb, wrap, group, sync=None,
          find_unused_parameters=False, param_groups=None, **opt_kwargs):
    sync = _exact_only("zero3", sync)
    if sync.collectives == "auto":  # hybrid sharding holds more per rank: by name only
        sync = dataclasses.replace(sync, collectives="native")
    if sync.collectives not in ("native", "hierarchical"):
        raise UsageError(f"--strategy zero3 takes --collectives native or hierarchical "
                         f"(hybrid sharding), not {sync.collectives}")
    model = FullyShardedDataParallel(module, wrap=wrap or default_wrap(module),
                                     mixed_precision=parse_precision(precision), group=group,
                                     hybrid=sync.collectives == "hierarchical",
                                     find_unused_parameters=find_unused_parameters)
    params = model.parameters() if param_groups is None else model.param_groups(param_groups)
    return _chose(FullyShardedStrategy("zero3", precision, model,
                                       optimizer_class(params, **opt_kwargs)), sync)
