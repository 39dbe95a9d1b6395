"""Checkpoints kept beside ``checkpoint.pt``: the last N (``--keep-last``) and the best by a
held-out figure (``--keep-best``), each a whole unit a run can continue from.

The layout, ``RUN/checkpoints/``:

* ``step-0000040/checkpoint.pt`` and, for ZeRO, ``step-0000040/checkpoint-shards/step-0000040/``:
  a kept unit has exactly the layout of a run directory's own checkpoint, so everything
  that reads a checkpoint reads a kept one unchanged -- verification (``unit.read_unit``:
  every byte, the shards' identity, data only), ``gradsync export``, ``gradsync eval`` and
  ``--resume-from`` (which installs a unit into a new run directory, :func:`install`);
* ``kept.json``: which units are the last N and which is the best (step, figure, value),
  for the reader and for the names ``RUN/checkpoints/best`` and ``RUN/checkpoints/last``
  (:func:`resolve_ref`). What the run itself trusts is the record inside each
  ``checkpoint.pt`` (``"kept"``), not this file.

Decisions:

* **A unit costs no copy.** ``checkpoint.pt`` and its shard files are never written in
  place: each save writes new files and renames them (``gradsync/atomic.py``), so a unit
  is made of hard links to the files the save just wrote, and later saves leave them
  as they are. Where a link cannot be made (a file system without them) the file is
  copied. A kept unit holds its bytes while it is kept: the free-space check counts
  them (``size.space_needed``).
* **Made and pruned atomically.** A unit is assembled in a temporary directory
  (``.tmp-...``, swept at the next start like every temporary of a crashed save) and
  renamed into place whole; a unit leaves by being renamed to such a name first and then
  removed. So ``step-N`` is always complete or absent.
* **Which units exist follows the checkpoint.** Every save records the kept lists as they
  are after it (the last N saves -- every ``--checkpoint-every``, each new best, the end
  -- and the best's step), in ``checkpoint.pt``; then the unit is made and the others
  pruned. A resume restores the lists from the checkpoint it continues and brings the
  directory back to them (:func:`reconcile`): a unit of a later step -- left by an
  attempt whose steps are now taken again -- is removed, the checkpoint's own unit is
  made if a crash came between its save and its link, and a unit the lists name that
  is not there (removed by hand, or left in the directory ``--resume-from`` continued)
  is said and dropped -- the best's value still decides what a new best is, so a
  continued run chooses as the uninterrupted one would. A fresh start in the directory removes
  the units of the run it replaces, as it starts ``metrics.jsonl`` afresh.
* gradsync writes only inside its own run directory, under ``checkpoints/``, never
  through a link: a symbolic link where a unit, its files or ``checkpoints/`` should be
  is refused, never followed; and it removes only units of a ``checkpoints/`` its index
  marks as its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass, field

from ...atomic import TMP_PREFIX, fsync_dir, storage_error
from ...errors import UsageError
from ...rundir import CHECKPOINT, KEPT, KEPT_INDEX, read_json, write_json

UNIT = re.compile(r"^step-(\d{7,})$")
NAMES = ("best", "last")


def unit_name(step: int) -> str:
    return f"step-{int(step):07d}"


def unit_dir(out: str, step: int) -> str:
    return os.path.join(out, KEPT, unit_name(step))


@dataclass
class Kept:
    """The last ``last_n`` saves' steps (``--keep-last``), checkpointed with every save; the
    best's step comes from the watch (``step/monitor.Watch``)."""

    last_n: int = 0
    last: list[int] = field(default_factory=list)
    shards: str | None = None  # the shard directory of the run's current checkpoint

    def after_save(self, step: int) -> list[int]:
        """The last-N list once ``step`` is saved (recorded before the save is written)."""
        if not self.last_n:
            return []
        return [s for s in self.last if s != step][-(self.last_n - 1):] + [step] \
            if self.last_n > 1 else [step]

    def state_dict(self) -> dict:
        return {"last": list(self.last)}

    def load_state_dict(self, state: dict | None) -> None:
        got = (state or {}).get("last") or []
        self.last = [int(s) for s in got if isinstance(s, int)][-self.last_n:] \
            if self.last_n else []


# ------------------------------------------------------------------------------ the files

def _refuse_link(path: str) -> None:
    if os.path.islink(path):
        raise UsageError(f"{path} is a symbolic link where gradsync keeps its checkpoints; "
                         "gradsync never writes through one: remove it")


def _root(out: str) -> str:
    root = os.path.join(out, KEPT)
    _refuse_link(root)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise storage_error(e, "the kept checkpoints", root) from None
    return root


def _temporary(root: str, name: str) -> str:
    return os.path.join(root, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}")


def _link_or_copy(src: str, dst: str) -> None:
    """``dst`` names ``src``'s bytes: a hard link, or a copy where links are refused.

    ``src`` must be a regular file (never a link followed); ``dst`` is new."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"{src} is not a regular file")
    try:
        os.link(src, dst, follow_symlinks=False)
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK,
                           errno.EOPNOTSUPP):
            raise
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         stat.S_IMODE(st.st_mode))
        try:
            with open(fd_in, "rb", closefd=False) as fin, open(fd_out, "wb", closefd=False) as fo:
                shutil.copyfileobj(fin, fo, 1 << 20)
                fo.flush()
                os.fsync(fd_out)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _fill(src_dir: str, dst_dir: str, shard_dir: str | None) -> None:
    """``dst_dir`` (new, empty) gets ``src_dir``'s checkpoint.pt and its shard directory."""
    if shard_dir:
        src_shards, dst_shards = os.path.join(src_dir, shard_dir), os.path.join(dst_dir, shard_dir)
        os.makedirs(dst_shards)
        for name in sorted(os.listdir(src_shards)):
            _link_or_copy(os.path.join(src_shards, name), os.path.join(dst_shards, name))
        fsync_dir(dst_shards)
        fsync_dir(os.path.dirname(dst_shards))
    _link_or_copy(os.path.join(src_dir, CHECKPOINT), os.path.join(dst_dir, CHECKPOINT))
    fsync_dir(dst_dir)


def _remove(root: str, name: str) -> None:
    """``root/name`` out of the way atomically (renamed to a temporary), then removed."""
    path = os.path.join(root, name)
    gone = _temporary(root, name)
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    fsync_dir(root)
    shutil.rmtree(gone, ignore_errors=True)


def make_unit(out: str, step: int, shard_dir: str | None) -> None:
    """``RUN/checkpoints/step-N`` from the run's current checkpoint (just saved), whole."""
    root = _root(out)
    name = unit_name(step)
    tmp = _temporary(root, name)
    try:
        os.mkdir(tmp)
        _fill(out, tmp, shard_dir)
        target = os.path.join(root, name)
        _refuse_link(target)
        if os.path.lexists(target):  # a step taken again: the new unit replaces the old
            _remove(root, name)
        os.rename(tmp, target)
        fsync_dir(root)
    except OSError as e:
        raise storage_error(e, f"the kept checkpoint of step {step}",
                            os.path.join(root, name)) from None
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def units(out: str) -> list[int]:
    """The steps of the units in ``RUN/checkpoints`` (temporaries aside), sorted."""
    root = os.path.join(out, KEPT)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := UNIT.match(n)))


def prune(out: str, keep: set[int]) -> list[int]:
    """Remove every unit whose step is not in ``keep`` (each atomically); the removed.

    Only where ``RUN/checkpoints`` is gradsync's, marked by its index (written with the
    first unit): a ``checkpoints/step-N`` another tool left in a directory handed over with
    ``--overwrite`` is not touched."""
    root = os.path.join(out, KEPT)
    if not os.path.isfile(os.path.join(root, KEPT_INDEX)):
        return []
    gone = [s for s in units(out) if s not in keep]
    for step in gone:
        _remove(root, unit_name(step))
    return gone


def write_index(out: str, last: list[int], best: dict | None, watched: str | None) -> None:
    """``RUN/checkpoints/kept.json``: the last N and the best, by step and directory."""
    if not last and not best and not os.path.isdir(os.path.join(out, KEPT)):
        return
    _root(out)
    index = {"last": [{"step": s, "dir": unit_name(s)} for s in last]}
    if best:  # its unit may be elsewhere (--resume-from): then named without a directory
        here = os.path.isdir(unit_dir(out, best["step"]))
        index["best"] = {"step": best["step"], "dir": unit_name(best["step"]) if here else None,
                         "metric": watched, "value": best["value"]}
    write_json(os.path.join(out, KEPT, KEPT_INDEX), index, what="the kept checkpoints' index")


def after_save(out: str, step: int, shard_dir: str | None, last: list[int],
               best: dict | None, watched: str | None) -> None:
    """Rank 0, once ``checkpoint.pt`` of ``step`` is in place: its unit if it is kept, the
    index, and every unit no longer kept removed."""
    keep = set(last) | ({best["step"]} if best else set())
    if step in keep:
        make_unit(out, step, shard_dir)
    if keep or units(out):
        write_index(out, last, best, watched)
        prune(out, keep)


def reconcile(out: str, step: int, shard_dir: str | None, last: list[int],
              best: dict | None, watched: str | None) -> tuple[list[int], dict | None, list[str]]:
    """Rank 0 at the start: the directory brought back to the kept lists of the checkpoint
    the run continues (``step``; 0: a fresh start). Returns the lists (a unit gone missing
    dropped) and notes for the user."""
    notes = []
    present = set(units(out))
    keep = set(last) | ({best["step"]} if best else set())
    if step and step in keep and step not in present:
        make_unit(out, step, shard_dir)  # a crash between the save and its link
        present.add(step)
    missing = sorted(s for s in keep if s not in present)
    if missing:  # removed by hand, or kept in the directory --resume-from continued
        notes.append(f"kept checkpoint(s) of step {', '.join(map(str, missing))} are not in "
                     f"{os.path.join(out, KEPT)} (removed, or kept where this run was "
                     "continued from): no longer kept here"
                     + ("; the best's value still decides what a new best is"
                        if best and best["step"] in missing else ""))
        last = [s for s in last if s not in missing]
    gone = prune(out, set(last) | ({best["step"]} if best else set()))
    later, earlier = [s for s in gone if s > step], [s for s in gone if s <= step]
    if later:
        why = ("a fresh run starts here" if not step else
               f"the run continues from step {step}, and they were saved by an attempt whose "
               "later steps are taken again")
        notes.append(f"removed kept checkpoint(s) of step {', '.join(map(str, later))}: {why}")
    if earlier:
        notes.append(f"removed kept checkpoint(s) of step {', '.join(map(str, earlier))}: the "
                     f"checkpoint of step {step} no longer keeps them (another --keep-last, or "
                     "--keep-best of another figure)")
    if keep or gone or present:
        write_index(out, last, best, watched)
    return last, best, notes


# ------------------------------------------------------------------------ finding a unit

def resolve_ref(path: str, flag: str) -> str:
    """The directory holding the checkpoint ``path`` names: a run directory, a kept unit
    (``RUN/checkpoints/step-N``), ``RUN/checkpoints/best`` or ``.../last`` (through the
    index), or a ``checkpoint.pt`` itself. One line naming ``flag`` when it names none."""
    path = os.fspath(path)
    if os.path.basename(path) == CHECKPOINT and os.path.isfile(path):
        return os.path.dirname(path) or "."
    if os.path.isfile(os.path.join(path, CHECKPOINT)):
        return path
    parent, name = os.path.split(os.path.normpath(path))
    if name in NAMES and os.path.basename(parent) == KEPT:
        index = read_json(os.path.join(parent, KEPT_INDEX))
        entry = None
        if isinstance(index, dict):
            got = index.get(name)
            entry = got[-1] if name == "last" and isinstance(got, list) and got else got
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, int) and os.path.isfile(os.path.join(parent, unit_name(step),
                                                                 CHECKPOINT)):
            return os.path.join(parent, unit_name(step))
        if index is None:
            raise UsageError(f"{flag} {path}: {os.path.dirname(parent) or '.'} keeps no "
                             "checkpoint besides its newest (it was trained without --keep-last "
                             "or --keep-best); name the run directory for its newest")
        how = (f" here (its best, step {step}, was kept where this run was continued from)"
               if isinstance(step, int) else
               " (it was trained without --keep-best)" if name == "best" else "")
        raise UsageError(f"{flag} {path}: {os.path.join(parent, KEPT_INDEX)} names no {name} "
                         f"checkpoint{how}")
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such file or directory")
    kept = units(path)
    hint = (f" (it keeps {', '.join(unit_name(s) for s in kept[-3:])} under {KEPT}/)"
            if kept else "")
    raise UsageError(f"{flag} {path} holds no checkpoint ({CHECKPOINT}){hint}: name a run "
                     f"directory, a kept checkpoint (RUN/{KEPT}/step-N) or RUN/{KEPT}/best")


def install(src: str, out: str) -> None:
    """``--resume-from``: the unit in ``src`` (verified by the caller) becomes ``out``'s
    checkpoint -- its shard directory first, then ``checkpoint.pt``, which makes it current."""
    from ...safeload import load as safe_load

    state = safe_load(os.path.join(src, CHECKPOINT), f"checkpoint {src}", mmap=True)
    shard_dir = state.get("optimizer_shards") if isinstance(state, dict) else None
    tmp = os.path.join(out, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{CHECKPOINT}")
    try:
        if shard_dir:
            target = os.path.join(out, shard_dir)
            staged = target + f".tmp-{secrets.token_hex(4)}"  # swept at the next start
            os.makedirs(staged)
            for name in sorted(os.listdir(os.path.join(src, shard_dir))):
                _link_or_copy(os.path.join(src, shard_dir, name), os.path.join(staged, name))
            fsync_dir(staged)
            if os.path.lexists(target):
                shutil.rmtree(target)
            os.rename(staged, target)
            fsync_dir(os.path.dirname(target))
        _link_or_copy(os.path.join(src, CHECKPOINT), tmp)
        os.replace(tmp, os.path.join(out, CHECKPOINT))
        fsync_dir(out)
    except OSError as e:
        raise storage_error(e, "the checkpoint --resume-from names", out) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
