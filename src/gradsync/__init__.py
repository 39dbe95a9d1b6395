"""gradsync: exact, overlapped data-parallel training for PyTorch.

The public API is re-exported here; nothing else lives in this file.
"""

from .errors import (
    GradsyncError,
    ReplicaMismatchError,
    UnusedParametersError,
    UsageError,
    WorkerFailedError,
)

__version__ = "0.1.0"

__all__ = [
    "GradsyncError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "UsageError",
    "WorkerFailedError",
    "__version__",
]
