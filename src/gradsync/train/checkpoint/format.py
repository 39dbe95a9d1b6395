"""Checkpoint files that are complete, verified, or absent.

Writing: through gradsync's one atomic writer (:mod:`gradsync.atomic`): into a
temporary file, fsynced, then renamed over the old one, so a crash, a Ctrl-C or a
full disk mid-save leaves the previous checkpoint untouched; the temporary file is
removed on the way out (or, after a SIGKILL, at the next start). torch.save reports
a full disk as "unexpected pos N vs M"; the file object here records the operating
system's own error, so the message says "no space left on device" first.

Reading: a checkpoint is checked before anything uses it. torch.save writes a
zip archive whose entries carry CRC-32s that ``torch.load`` never checks, so a
flipped byte inside tensor data loads silently (and a run "resumed" from it
diverges). :func:`verify` checks every entry's CRC, and each tensor's own CRC-32
recorded at save time names which tensor holds the damage. Every read is a
weights-only load (:mod:`gradsync.safeload`): a checkpoint is data, never code, even
when its checksums are as valid as its author made them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import zipfile
import zlib

import torch

from ...atomic import replacing, storage_error  # noqa: F401 - storage_error: state.py's
from ...errors import UnsafeFileError, UsageError
from ...rundir import KEPT, SHARDS, TMP_PREFIX
from ...safeload import load as safe_load

FORMAT = "gradsync-checkpoint"
VERSION = 3  # 3: the unit record (run id, step, config digest, shard checksums)


class CheckpointCorrupt(UsageError):
    """A checkpoint whose bytes are not what was written (named: file and tensor)."""


class _RecordingFile:
    """A file for torch.save that keeps the first OSError its writes raised."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def tensor_digests(obj, prefix: str = "") -> dict[str, int]:
    """CRC-32 of every tensor's bytes in a nested dict/list, keyed by its path."""
    out: dict[str, int] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        out[prefix] = zlib.crc32(t.view(torch.uint8).numpy()) if t.numel() else 0
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensor_digests(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensor_digests(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


def atomic_save(obj: dict, path: str, before_replace=None) -> int:
    """torch.save ``obj`` (with its tensors' CRC-32s) so readers see the old file or the new.

    ``before_replace`` runs after the new file is complete and before it replaces
    the old one (fault injection uses it). Returns the file size in bytes.
    """
    payload = {**obj, "digests": tensor_digests(obj)}
    with replacing(path, "the checkpoint", before_replace) as raw:
        f = _RecordingFile(raw)
        try:
            torch.save(payload, f)
        except RuntimeError:
            if f.error is not None:
                raise f.error from None
            raise
        raw.flush()
        size = os.fstat(raw.fileno()).st_size
    return size


def remove_stale_temporaries(directory: str) -> list[str]:
    """Temporary files and shard directories left by a process killed outright mid-save."""
    stale = glob.glob(os.path.join(directory, f"{TMP_PREFIX}*"))
    stale += glob.glob(os.path.join(directory, SHARDS, "*.tmp-*"))
    stale += glob.glob(os.path.join(directory, SHARDS, "*.old-*"))
    stale += glob.glob(os.path.join(directory, KEPT, f"{TMP_PREFIX}*"))  # kept units (kept.py)
    for path in stale:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return stale


def _damaged(path: str, detail: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"checkpoint {path} is corrupted: {detail}; the run cannot "
                             "continue from it (restore a good copy, or start a new run with "
                             "another --out)")


def verify(path: str) -> None:
    """Check every zip entry's CRC-32 (all of the file's content); name what is damaged."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointCorrupt(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                                "it may be truncated or from another program") from None
    if bad is None:
        return
    if bad.endswith("data.pkl"):
        raise _damaged(path, f"its index ({bad}) fails its checksum")
    try:
        state = safe_load(path, f"checkpoint {path}")
        saved = state.get("digests") or {}
        now = tensor_digests({k: v for k, v in state.items() if k != "digests"})
        names = [k for k, crc in saved.items() if now.get(k) != crc]
    except Exception:  # noqa: BLE001 - we only try to name the tensor here
        names = []
    where = (f"tensor {names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
             if names else f"entry {bad}")
    raise _damaged(path, f"{where} does not match its checksum (flipped bytes)")


def load_checkpoint(path: str, verified: bool = True) -> dict:
    """Load a checkpoint written by :func:`atomic_save`; damaged files are named, not used."""
    if not os.path.exists(path):
        raise UsageError(f"no checkpoint at {path}")
    if verified:
        verify(path)
    try:
        state = safe_load(path, f"checkpoint {path}")
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorrupt(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                                "it may be truncated or from another program") from None
    return state

