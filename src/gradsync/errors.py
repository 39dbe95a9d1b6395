"""Exceptions gradsync raises on purpose, so callers can tell them from bugs."""

from __future__ import annotations


class GradsyncError(RuntimeError):
    """Base class for errors gradsync raises deliberately."""


class UsageError(GradsyncError, ValueError):
    """Bad arguments or configuration; the CLI prints one line and exits with code 2."""


class ReplicaMismatchError(GradsyncError):
    """Ranks disagree on something that must be identical (model structure, drift)."""


class UnusedParametersError(GradsyncError):
    """Parameters received no gradient in a synchronised backward."""


class WorkerFailedError(GradsyncError):
    """A worker process raised, died or timed out; names the rank and its error."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class StorageError(GradsyncError):
    """Writing a run's file failed (no space, I/O error, read-only); the message starts with
    the cause and names the file, and what was there before is intact."""

    def __init__(self, message: str, errno_: int = 0):
        super().__init__(message)
        self.errno = errno_


class UnsafeFileError(UsageError):
    """A file gradsync will not load, because loading it would run code: a pickle that
    names a function or class beyond tensors and plain data (a crafted checkpoint, or
    another program's objects). One line naming the file and what it names; exit code 2."""
