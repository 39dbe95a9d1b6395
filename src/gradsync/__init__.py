"""gradsync: exact, overlapped data-parallel training for PyTorch.

The public API is re-exported here; nothing else lives in this file.
"""

from .dist import init, is_main, rank, shutdown, world_size
from .engine.clip import clip_grad_norm_
from .engine.data_parallel import DataParallel
from .engine.fsdp import FullyShardedDataParallel
from .engine.mixed_dp import MixedPrecisionOptimizer
from .engine.precision import MixedPrecision
from .engine.zero import ZeroOptimizer
from .errors import (
    GradsyncError,
    ReplicaMismatchError,
    UnusedParametersError,
    UsageError,
    WorkerFailedError,
)
from .launch import spawn

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "MixedPrecisionOptimizer",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "GradsyncError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "UsageError",
    "WorkerFailedError",
    "__version__",
    "init",
    "is_main",
    "rank",
    "shutdown",
    "spawn",
    "world_size",
]
