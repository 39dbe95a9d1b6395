"""gradsync: exact, overlapped data-parallel training for PyTorch.

The public API is re-exported here; nothing else lives in this file.
"""

from .data import DistributedSampler, SamplerAudit, audit_indices, audit_sampler
from .dist import init, is_main, rank, shutdown, world_size
from .engine.data_parallel import DataParallel
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
    "DistributedSampler",
    "GradsyncError",
    "ReplicaMismatchError",
    "SamplerAudit",
    "UnusedParametersError",
    "UsageError",
    "WorkerFailedError",
    "__version__",
    "audit_indices",
    "audit_sampler",
    "init",
    "is_main",
    "rank",
    "shutdown",
    "spawn",
    "world_size",
]
