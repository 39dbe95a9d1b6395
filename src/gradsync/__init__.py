"""gradsync: exact, overlapped data-parallel training for PyTorch.

The public API, re-exported here and nothing else. Names resolve on first use
(PEP 562), so ``import gradsync.plan`` and ``gradsync plan ...`` stay free of
torch: the planner is pure arithmetic and starts instantly.
"""

from __future__ import annotations

import importlib

from .errors import (
    GradsyncError,
    ReplicaMismatchError,
    UnusedParametersError,
    UsageError,
    WorkerFailedError,
)

__version__ = "0.1.0"

_LAZY = {
    "DataParallel": "gradsync.engine.replicated.data_parallel",
    "DistributedSampler": "gradsync.data.sampler",
    "SamplerAudit": "gradsync.data.audit",
    "audit_indices": "gradsync.data.audit",
    "audit_sampler": "gradsync.data.audit",
    "init": "gradsync.dist",
    "is_main": "gradsync.dist",
    "rank": "gradsync.dist",
    "shutdown": "gradsync.dist",
    "world_size": "gradsync.dist",
    "spawn": "gradsync.launch",
    "check_replicas": "gradsync.engine.sync.drift",
    "Tracer": "gradsync.engine.transport.tracing",
    "write_report": "gradsync.observe.report",
    "ZeroOptimizer": "gradsync.engine.sharded.zero",
    "FullyShardedDataParallel": "gradsync.engine.sharded.fsdp.wrapper",
    "MixedPrecision": "gradsync.engine.replicated.precision",
    "LossScale": "gradsync.engine.sync.loss_scale",
    "LossScaler": "gradsync.engine.sync.loss_scale",
    "MixedPrecisionOptimizer": "gradsync.engine.replicated.mixed_optimizer",
    "clip_grad_norm_": "gradsync.engine.sharded.clip",
    "SyncBatchNorm": "gradsync.engine.sync.batchnorm",
    "convert_sync_batchnorm": "gradsync.engine.sync.batchnorm",
    "DiLoCo": "gradsync.engine.local.diloco",
    "StreamingDiLoCo": "gradsync.engine.local.streaming",
    "parse_compression": "gradsync.engine.compress",
    "gradient_distance": "gradsync.engine.compress",
    "Compressor": "gradsync.engine.compress",
    "CompressedBuckets": "gradsync.engine.compress",
    "HostCompressedBuckets": "gradsync.engine.compress",
    "CompressionStats": "gradsync.engine.compress",
    "HalfPrecisionCompressor": "gradsync.engine.compress",
    "Int8Compressor": "gradsync.engine.compress",
    "PowerSGDCompressor": "gradsync.engine.compress",
    "Strategy": "gradsync.engine.strategy.base",
    "build_strategy": "gradsync.engine.strategy.registry",
    "register_strategy": "gradsync.engine.strategy.registry",
    "StepSampler": "gradsync.data.sampler",
    "ShareBalancer": "gradsync.data.balance",
    "DesyncError": "gradsync.engine.transport.fingerprint",
    "BusyClock": "gradsync.engine.transport.busy_clock",
    "train": "gradsync.train.launcher.api",
    "evaluate": "gradsync.train.launcher.evaluate",
    "TrainConfig": "gradsync.train.config.train_config",
    "TrainData": "gradsync.train.task.build",
    "Callback": "gradsync.train.records.callbacks",
    "CallbackInfo": "gradsync.train.records.callbacks",
    "FaultInjector": "gradsync.train.worker.faults",
}

__all__ = [
    "GradsyncError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "UsageError",
    "WorkerFailedError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
