"""The run directory checked before any worker starts, and locked while a run uses it.

Checks (each one line, exit 2, before any process is started): ``--out`` is a
file; ``--out`` is not gradsync's (:mod:`gradsync.ownership`): it holds files gradsync
did not write -- another tool's ``config.json`` and ``metrics.jsonl`` -- and no
``gradsync-run.json`` marker, so a run would replace them (``--overwrite`` goes on); a
directory of a gradsync from before the marker is recognised by its checkpoint
(verified next, as every checkpoint is) or its gradsync-shaped ``config.json``, and
marked when a run takes it (:meth:`RunLock.claim`); ``--out`` cannot be written (tested by
writing, since root ignores mode bits but not a read-only mount); its device has
less free space than a save needs (``checkpoint/size.space_needed``: what the save writes
for this strategy, sync method and compressor, counted twice -- the previous
checkpoint stays until the new one is complete -- less what the current checkpoint
already occupies).

The lock is an advisory ``flock`` on ``OUT/gradsync.lock``, whose content names
the holder (host, pid, start time). It is opened with ``O_NOFOLLOW`` and used only if
it is a regular file with one name: a symbolic or hard link planted there (to
someone's file) is refused in one line, never truncated -- every run, even a refused
one, rewrites the lock's content. The kernel drops it when the holder exits,
however it exits, so a lock left by a dead process is simply taken over (and
said so); Linux's NFS client maps ``flock`` onto POSIX locks, which work across
nodes. Who holds it: ``gradsync train`` (and ``gradsync.train()`` launching
workers) holds it in the launching process for the whole run, restarts
included, so its own workers never contend for it; under ``torchrun`` the
launcher is not ours, so global rank 0 takes it after connecting -- a restarted
rank 0 finds the lock its killed predecessor held already released.

A finished run leaves no lock file: ``release`` removes it while still holding the
lock. Removing a ``flock``ed file is safe only with a check on the other side: a
process that opened the file just before it was removed can lock the orphaned
inode after the holder closes it, while a third process creates a new file and
locks that -- two holders. So ``acquire``, once it holds the lock, checks that the
path still names the very inode it locked, and starts again if not. A lock file
that stays behind with a holder in it therefore always means a holder that died
(taken over, and said so); an empty one, a run interrupted between truncating and
removing it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time

from ...errors import UsageError
from ...ownership import entries, mark, marked, refusal
from ...rundir import (
    BASELINE,
    CHECKPOINT,
    CONFIG,
    KEPT,
    LOCK,
    MARKER,
    RUN_FORMAT,
    SHARDS,
    read_json,
)

PROBE = ".write-test-"
OWN_NAMES = {LOCK, MARKER, SHARDS, KEPT, BASELINE, "flight", "restart.json"}
"""Names in a run directory that only gradsync writes: a directory holding nothing else
(a run killed before its first file) is gradsync's."""
GRADSYNC_CONFIG = {"global_batch", "micro_batch", "strategy", "steps", "model", "data"}
"""Fields every gradsync run's config.json has had: how a run directory from before
the marker is recognised."""


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def free_space(path: str) -> int:
    """Free bytes on ``path``'s device (a seam: tests stand in for a nearly full disk)."""
    return shutil.disk_usage(path).free


def _gradsync_config(out: str) -> bool:
    value = read_json(os.path.join(out, CONFIG))
    return isinstance(value, dict) and GRADSYNC_CONFIG <= set(value)


def check_owned(out: str, overwrite: bool = False) -> None:
    """Raise one UsageError unless gradsync may write into ``out`` (module docstring)."""
    found = entries(out)
    if overwrite or not found or marked(out, MARKER, RUN_FORMAT):
        return
    if CHECKPOINT in found or _gradsync_config(out):  # a run from before the marker
        return
    others = [n for n in found if n not in OWN_NAMES and not n.startswith(PROBE)]
    if others:
        raise refusal(f"--out {out}", others, "choose another --out (a new or empty directory)",
                      "a run's files (config.json, metrics.jsonl, checkpoint.pt, ...)")


def check_run_dir(out: str, need_bytes: int | None = None, free=None,
                  overwrite: bool = False) -> None:
    """Raise one UsageError naming the first problem with ``out``; create it if absent.

    ``need_bytes``: free space a save needs; ``free``: a function giving the free bytes
    of a path (default :func:`free_space`); ``overwrite``: ``--overwrite`` (write into a
    directory that is not gradsync's)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a directory; choose another --out")
    check_owned(out, overwrite)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out} cannot be created: {e.strerror or e}") from None
    probe = os.path.join(out, f"{PROBE}{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(probe)  # one left by a killed run of this pid (a link: the link only)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("x")
    except OSError as e:
        why = ("read-only file system" if e.errno == errno.EROFS else
               "no space left on device" if e.errno == errno.ENOSPC else e.strerror or str(e))
        raise UsageError(f"--out {out} is not writable ({why}); choose another --out") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    if need_bytes:
        have = (free or free_space)(out)
        if have < need_bytes:
            raise UsageError(f"--out {out}: {_size(have)} free on its device, but a checkpoint "
                             f"needs about {_size(need_bytes)} (the new one beside the "
                             "previous one while it is saved); free space or choose another "
                             "--out")


def _describe(holder: dict) -> str:
    since = holder.get("since")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
            if isinstance(since, (int, float)) and 0 < since < 2**40 else "?")
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {when}"


class RunLock:
    """An exclusive, non-blocking lock on a run directory (see the module docstring)."""

    def __init__(self, out: str, created: bool = False):
        self.out = out
        self.path = os.path.join(out, LOCK)
        self.fd: int | None = None
        self.took_over: dict | None = None
        self.created = created  # this invocation made ``out``: remove it if left unused
        self.marked = False  # this invocation wrote the marker: remove it if left unused

    def _read(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        try:
            holder = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def _same_file(self, fd: int) -> bool:
        """Whether ``self.path`` still names the inode ``fd`` holds (see the module doc)."""
        try:
            st, mine = os.lstat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _open(self) -> int:
        """The lock file, opened (created if absent) without following a link; refused
        unless a regular file with one name, which gradsync may rewrite."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UsageError(f"{self.path} is a symbolic link (to {os.readlink(self.path)}), "
                                 "not gradsync's lock file, and gradsync never writes through "
                                 "a link: remove it, then run again") from None
            raise UsageError(f"{self.path} cannot be opened as gradsync's lock file "
                             f"({e.strerror or e}): remove it, then run again") from None
        st = os.fstat(fd)  # no names (0): a file its holder just removed, retried by _lock
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = ("a hard link: one of the " + str(st.st_nlink) + " names of a file"
                    if stat.S_ISREG(st.st_mode) else "not a regular file")
            raise UsageError(f"{self.path} is {what}, not gradsync's lock file, which every "
                             "run rewrites: remove it, then run again")
        return fd

    def _lock(self) -> int:
        """A descriptor of the lock file, locked, and the file still at ``self.path``."""
        for _ in range(100):  # each retry means a holder released between open and flock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                raise UsageError(f"{self.out} is in use by another gradsync run "
                                 f"({_describe(holder)}); wait for it to finish, or choose "
                                 "another --out") from None
            if self._same_file(fd):
                return fd
            os.close(fd)  # we locked a file its holder had just removed: take the new one
        raise UsageError(f"{self.path} keeps being replaced; is another program removing it?")

    def acquire(self) -> RunLock:
        fd = self._lock()
        previous = self._read(fd)
        self.took_over = previous or None  # content without a lock: its holder died
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
              "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return self

    def claim(self) -> None:
        """Mark ``out`` as a gradsync run directory, once its checkpoint (if any) is
        verified; the lock holder alone writes the marker."""
        if not marked(self.out, MARKER, RUN_FORMAT):
            mark(self.out, MARKER, RUN_FORMAT, note="a gradsync run directory: gradsync "
                                                    "train may write its files here")
            self.marked = True

    def note(self) -> str | None:
        """A line about a stale lock taken over, if there was one."""
        if not self.took_over:
            return None
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id and self.took_over.get("run_id") == run_id:
            return None  # this run's own worker, before the launcher restarted it
        return (f"took over the lock of a run that is no longer running "
                f"({_describe(self.took_over)})")

    def release(self) -> None:
        """Empty the file, remove it while still holding it (acquirers re-check the inode:
        see the module docstring), then unlock. A run directory nothing else wrote to (a
        usage error before the first step) loses the marker this invocation wrote, and is
        removed if this invocation created it, so a failed start leaves no empty run
        behind and an empty directory that was there stays empty."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            if self._same_file(self.fd):
                os.remove(self.path)  # still locked: nobody else is inside
            unused = set(os.listdir(self.out)) <= ({MARKER} if self.marked else set())
            if unused and self.marked:
                os.remove(os.path.join(self.out, MARKER))
            if unused and self.created:
                os.rmdir(self.out)
        os.close(self.fd)  # closing the last descriptor drops the flock
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
