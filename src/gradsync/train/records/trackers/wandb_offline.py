"""``--log wandb``: a W&B run, offline, in ``RUN/wandb/`` (``wandb sync RUN/wandb/offline-run-*``).

Offline unless ``WANDB_MODE`` says otherwise (a user who exports ``WANDB_MODE=online``
and is logged in gets an online run: the choice is theirs, not the trainer's);
project ``$WANDB_PROJECT`` or ``gradsync``; the run is named after its directory
and its W&B id is gradsync's run id (the checkpoint's). The W&B run id is kept in
``trackers.json``, so every resume and restart continues the same run
(``resume="allow"``), each attempt in its own ``offline-run-*`` folder, which
``wandb sync`` joins. Console capture and W&B's own lines are off: the trainer's
progress display owns the terminal.

What the folders hold is read back on every open, from their ``.wandb`` logs
(:func:`logged_steps`), not assumed: an attempt stopped before W&B wrote its last
records holds fewer steps than it was sent, and those are sent again. The history
cannot be cut back, so this tracker gets a step only once a checkpoint holds it
(``base.py``).

``RUN/wandb`` keeps the attempts of the run the directory holds, each with a step:
``wandb sync`` uploads every folder as (part of) a run, so a folder without a step
-- a Ctrl-C during start-up, an attempt stopped before its first checkpoint's steps
were sent -- would be an extra, empty run. Such a folder is removed when its attempt
closes, and when the next attempt opens (one killed before it could close); so are
the folders of another run id (attempts that a fresh start in this directory replaced:
no checkpoint continues them).
"""

from __future__ import annotations

import glob
import os
import shutil
import struct

from .base import KILLED, Outcome, Start, Tracker

WANDB_DIR = "wandb"
_BLOCK, _HEADER = 32768, 7  # a .wandb log: leveldb's log format, in 32 KiB blocks


def _records(path: str):
    """The protobuf records of a ``.wandb`` log (W&B's ``Record`` messages), up to the
    first damaged or unfinished one: a file of a stopped attempt may end mid-record."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        return
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        end = pos + _HEADER + length
        if end > len(data) or kind not in (1, 2, 3, 4):
            return
        chunk, pos = data[pos + _HEADER:end], end
        if kind in (2, 3):  # first, middle: a record spanning blocks
            pending = (pending if kind == 3 else b"") + chunk
            continue
        rec = pb.Record()
        try:
            rec.ParseFromString(pending + chunk if kind == 4 else chunk)
        except Exception:  # noqa: BLE001 - a damaged record ends what can be read
            return
        pending = b""
        yield rec


def logged_steps(path: str) -> list[int]:
    """The history steps a ``.wandb`` log holds."""
    return [rec.history.step.num for rec in _records(path)
            if rec.WhichOneof("record_type") == "history"]


def _folders(root: str) -> list[str]:
    """The run folders W&B made in ``root`` (offline and, with ``WANDB_MODE``, online)."""
    return sorted(p for p in glob.glob(os.path.join(root, "*run-*")) if os.path.isdir(p)
                  and not os.path.islink(p))


def _run_id(folder: str) -> str:
    return os.path.basename(folder).rsplit("-", 1)[-1]


def _steps_in(folder: str) -> list[int]:
    return [s for f in glob.glob(os.path.join(folder, "run-*.wandb")) for s in logged_steps(f)]


def _remove(folder: str) -> None:
    """Remove a run folder (and ``latest-run`` if it points there)."""
    latest = os.path.join(os.path.dirname(folder), "latest-run")
    if os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(folder):
        os.remove(latest)
    shutil.rmtree(folder, ignore_errors=True)


def tidy(root: str, run_id: str) -> int:
    """Remove ``root``'s offline folders of another run or without a step; the last step
    the run's own folders hold (0: none)."""
    last = 0
    for folder in _folders(root):
        mine = _run_id(folder) == run_id
        steps = _steps_in(folder) if mine else []
        if mine and steps:
            last = max(last, max(steps))
        elif os.path.basename(folder).startswith("offline-run-"):
            _remove(folder)
    return last


class WandbTracker(Tracker):
    name = "wandb"
    cuts_back = False

    def __init__(self, start: Start):
        import wandb

        saved = start.saved or {}
        run_id = (saved.get("run_id") if start.resumed else None) or start.run_id
        root = os.path.join(start.out, WANDB_DIR)
        held = tidy(root, run_id) if os.path.isdir(root) else 0
        self.through = held if start.resumed else 0
        settings = wandb.Settings(console="off", quiet=True, silent=True, save_code=False)
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE") or "offline", dir=start.out,
            project=os.environ.get("WANDB_PROJECT") or "gradsync", name=start.name,
            id=run_id, resume="allow",
            settings=settings)
        self.folder = os.path.dirname(os.path.abspath(self.run.dir))  # RUN/wandb/offline-run-*
        self.run.config.update(start.config, allow_val_change=True)  # a resume's flags
        self.state = {"run_id": run_id, "project": self.run.project}

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        self.run.log(values, step=step)

    def close(self, outcome: Outcome) -> None:
        if outcome.status == KILLED:
            self.run.mark_preempting()  # stopped, to be continued: W&B's "preempted"
        self.run.finish(exit_code=outcome.exit_code)
        offline = os.path.basename(self.folder).startswith("offline-run-")
        if offline and not self.sent and not _steps_in(self.folder):
            _remove(self.folder)  # nothing for wandb sync to upload as an extra run


def open_tracker(start: Start) -> Tracker:
    return WandbTracker(start)
