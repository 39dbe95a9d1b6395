"""Checkpoints that are either complete or absent: write a temporary file, then rename.

``os.replace`` is atomic on POSIX, so a crash or Ctrl-C mid-save leaves the
previous checkpoint untouched, and the temporary file is removed on the way out.
"""

from __future__ import annotations

import contextlib
import glob
import os

import torch

from ..errors import UsageError

CHECKPOINT = "checkpoint.pt"
_TMP_PREFIX = ".tmp-"


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_save(obj, path: str) -> None:
    """torch.save ``obj`` to ``path`` so readers see the old file or the new one, never half."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def remove_stale_temporaries(directory: str) -> list[str]:
    """Temporary files left by a process that was killed outright (SIGKILL) mid-save."""
    stale = glob.glob(os.path.join(directory, f"{_TMP_PREFIX}*"))
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return stale


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint written by :func:`atomic_save`, with a clear error if it is damaged."""
    if not os.path.exists(path):
        raise UsageError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise UsageError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                         "it may be truncated or from another program") from None
