"""The one way gradsync writes a file: whole or not at all, never through a link.

Every whole file gradsync writes -- a run directory's JSON, report and figures,
``checkpoint.pt``, each ZeRO shard file and its manifest, an export's weights --
goes through :func:`replacing` (or :func:`write_bytes` and :func:`write_by_name`,
built on the same steps):

* the new content goes to a temporary file beside the target,
  ``.tmp-PID-RANDOM-NAME``, created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: whatever
  is planted at that name (a file, a symbolic link to someone's file) is never
  opened, let alone truncated;
* it is created with mode ``0o666`` less the process's umask: the permissions the
  user's other new files get. A library that writes by file name and replaces the
  file with a private ``0o600`` one of its own (safetensors does) gets the same
  mode back before the rename;
* it is fsynced, renamed over the target -- ``os.replace`` is atomic on POSIX, and
  replaces a symbolic link at the target instead of writing through it -- and the
  directory is fsynced, so the rename itself survives a power cut;
* on failure the temporary file is removed (after a SIGKILL, at the next start:
  ``train/checkpoint.remove_stale_temporaries``) and the target is as it was. An
  ``OSError`` becomes one :class:`~gradsync.errors.StorageError` that leads with the
  cause ("no space left on device") and names the file, never a chain of tracebacks.

Torch-free, at the bottom of the package: ``runfiles`` (the run directory's files),
``engine/sharded/checkpoint.py`` (shards) and ``train/`` (checkpoints, exports) all
write through it. Before this there were three writers with two temporary-file
schemes, and only one of them fsynced the directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO

from .errors import StorageError

TMP_PREFIX = ".tmp-"  # removed at the next start if killed mid-write (train/checkpoint/format.py)

_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied",
           errno.EIO: "input/output error (the disk or its file system failed)",
           errno.ELOOP: "a symbolic link is in the way (gradsync never writes through one)"}

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def cause(e: OSError) -> str:
    """What went wrong, in words ("no space left on device")."""
    return _CAUSES.get(e.errno) or (os.strerror(e.errno) if e.errno else str(e))


def storage_error(e: OSError, what: str, path, after: str = "") -> StorageError:
    """``e`` as one line that leads with the cause and names the file."""
    return StorageError(f"{cause(e)} while writing {what} to {os.fspath(path)}{after}",
                        e.errno or 0)


def _intact(path: str) -> str:
    return " (the previous one is intact)" if os.path.lexists(path) else ""


def temporary_name(path: str) -> str:
    """A fresh name beside ``path`` for its next content (the prefix marks it as ours)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}")


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _install(tmp: str, path: str, before_replace: Callable[[], None] | None) -> None:
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(tmp))


@contextlib.contextmanager
def replacing(path, what: str,
              before_replace: Callable[[], None] | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the
    block ends without an exception (see the module docstring).

    ``what`` names the content in messages ("the checkpoint"); ``before_replace`` runs
    once the new file is complete and before it replaces the old one (fault injection).
    """
    path = os.fspath(path)
    tmp = temporary_name(path)
    try:
        with os.fdopen(os.open(tmp, _CREATE, 0o666), "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _install(tmp, path, before_replace)
    except OSError as e:
        raise storage_error(e, what, path, _intact(path)) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def write_bytes(path, data: bytes, what: str) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new."""
    with replacing(path, what) as f:
        f.write(data)


def write_by_name(path, what: str, writer: Callable[[str], None]) -> None:
    """Replace ``path`` with what ``writer(tmp)`` writes at the file name ``tmp``, for
    libraries that take a name rather than a file (safetensors, ``save_pretrained``).

    The writer raises ``OSError`` for a failed write (convert a library's own error
    first). The name is claimed as :func:`replacing` claims it, which also tells the
    mode the umask gives; the file gets that mode back, is fsynced and renamed.
    """
    path = os.fspath(path)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, _CREATE, 0o666)
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        os.close(fd)
        writer(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "the writer left something other than a file")
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        _install(tmp, path, None)
    except OSError as e:
        raise storage_error(e, what, path, _intact(path)) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
