"""A checkpoint is one unit: ``checkpoint.pt`` and its shard directory, of one run and one step.

Nothing in a checkpoint is believed before the whole unit is verified, on every
path that reads one (resuming, "already finished; nothing to do", the launcher's
preflight and its "continue from step N" hints, the sharded load itself):

1. ``checkpoint.pt``'s bytes: every zip entry's CRC-32 (``checkpoint.verify``), so a
   flipped bit in the pickled ``step`` is a checksum failure, not step 84 of 30;
2. what it holds: a dict of gradsync's format, with a whole-number ``step`` and the
   fields a resume reads (``model``, ``config``, ...); a tensor, a list, a string or
   a dict from another program is named as such, in one line;
3. its unit record (``unit``, format 3): the run id (drawn when the run starts, kept
   by every resume), the step and the configuration digest, and the SHA-256 of every
   file of its shard directory. The shard directory's ``manifest.json`` carries the
   same identity, so a directory of another run or another step -- even one with
   the same name and intact files -- is refused naming its manifest, and a file whose
   bytes changed is refused naming the file;
4. that every file of it is data: ``checkpoint.pt`` and each shard file load with
   torch's weights-only unpickler (:mod:`gradsync.safeload`; the shards memory-mapped,
   so their tensors are not read), because whoever wrote the files wrote the
   checksums above too: a crafted pickle with matching checksums is refused here, in
   one line, before any worker starts -- never unpickled in full.

Checkpoints of format 2 (before the unit record) are read with checks 1 and 2; the
sharded load still checks their files' SHA-256s against the shard manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import torch

from ...errors import UnsafeFileError
from ...safeload import load as safe_load
from .format import FORMAT, VERSION, CheckpointCorrupt, verify

MANIFEST = "manifest.json"
HEADER_KEYS = ("format", "version", "step", "world_size", "config", "loss", "steps",
               "world_sizes", "optimizer_shards", "watch")
_AGAIN = "restore a good copy, or start a new run with another --out"


def new_run_id() -> str:
    """A run's identity, drawn once when it starts fresh (resumes keep it)."""
    return uuid.uuid4().hex[:16]


def config_digest(config: dict, keys) -> str:
    """SHA-256 (16 hex digits) of the configuration fields that fix a run's trajectory."""
    fields = {k: config.get(k) for k in keys}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(run_id: str, step: int, digest: str) -> dict:
    """What ties the pieces of one checkpoint together (also in the shard manifest)."""
    return {"run_id": run_id, "step": int(step), "config_digest": digest}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shard_record(out: str, shard_dir: str) -> dict:
    """The unit's record of a freshly written shard directory: every file's SHA-256
    (the shard files' as the manifest lists them, and the manifest's own)."""
    root = os.path.join(out, shard_dir)
    with open(os.path.join(root, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    files = {name: meta["sha256"] for name, meta in manifest["files"].items()}
    files[MANIFEST] = _sha256(os.path.join(root, MANIFEST))
    return {"dir": shard_dir, "files": files}


def _what(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {list(obj.shape)}"
    if isinstance(obj, dict):
        keys = ", ".join(repr(k) for k in list(obj)[:4]) + (", ..." if len(obj) > 4 else "")
        return f"a dict with keys {keys}" if obj else "an empty dict"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    if isinstance(obj, str):
        return f"a string ({obj[:30]!r})"
    return f"a {type(obj).__name__}"


def _bad(path: str, detail: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"checkpoint {path} {detail}; the run cannot continue from it "
                             f"({_AGAIN})")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_fields(path: str, state) -> None:
    """Raise one line naming ``path`` and what is wrong unless ``state`` is a whole
    gradsync checkpoint (types of the fields a resume or a "finished" answer reads)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        what = _what(state)
        if isinstance(state, dict) and "format" in state:
            what += f" of format {state['format']!r}"
        raise _bad(path, f"is not a gradsync checkpoint: it holds {what}")
    version = state.get("version")
    if not _is_count(version) or version > VERSION:
        raise _bad(path, f"has format version {version!r}; this gradsync reads versions up to "
                         f"{VERSION}")
    if not _is_count(state.get("step")):
        raise _bad(path, f"is damaged: its step is {state.get('step')!r}, not a step number")
    needs = {"model": dict, "config": dict, "scheduler": dict, "world_size": int}
    needs.update({"sampler": dict} if "samplers" not in state else {"samplers": list})
    if version >= 3:
        needs["unit"] = dict
    for key, kind in needs.items():
        if key not in state:
            raise _bad(path, f"is incomplete: it has no {key!r}")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise _bad(path, f"is damaged: its {key!r} is {_what(state[key])}, not a "
                             f"{kind.__name__}")
    if "optimizer" not in state:
        raise _bad(path, "is incomplete: it has no 'optimizer'")
    shards = state.get("optimizer_shards")
    if shards is not None and (not isinstance(shards, str) or os.path.isabs(shards)
                               or ".." in shards.split("/")):
        raise _bad(path, f"is damaged: its shard directory is {shards!r}")
    if version >= 3:
        unit = state["unit"]
        if not isinstance(unit.get("run_id"), str) or unit.get("step") != state["step"]:
            raise _bad(path, "is damaged: its unit record does not match its step")
        if bool(shards) != isinstance(unit.get("shards"), dict):
            raise _bad(path, "is damaged: its unit record and its shard directory disagree")


def _manifest(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing: the checkpoint's shard directory is "
                                f"incomplete ({_AGAIN})") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{path} is unreadable ({e}) ({_AGAIN})") from None
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"{path} is not a shard manifest ({_AGAIN})")
    return manifest


def verify_shards(out: str, path: str, state: dict) -> None:
    """The shard directory ``state`` names belongs to it (same run, step, configuration)
    and every file in it has the bytes the unit recorded."""
    unit, rel = state.get("unit"), state.get("optimizer_shards")
    if not rel or not unit:
        return
    root = os.path.join(out, rel)
    mpath = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise CheckpointCorrupt(f"{root} is missing: checkpoint {path} keeps its sharded state "
                                f"there ({_AGAIN})")
    ident = _manifest(mpath).get("identity")
    want = identity(unit["run_id"], unit["step"], unit.get("config_digest"))
    if not isinstance(ident, dict):
        raise CheckpointCorrupt(f"{mpath} records no run identity: these shards are not the ones "
                                f"{path} (step {want['step']}) was saved with ({_AGAIN})")
    if ident.get("run_id") != want["run_id"]:
        raise CheckpointCorrupt(f"{mpath} belongs to another run (run id {ident.get('run_id')}; "
                                f"{path} is of run {want['run_id']}) ({_AGAIN})")
    if ident.get("step") != want["step"]:
        raise CheckpointCorrupt(f"{mpath} is of step {ident.get('step')}, but {path} is of step "
                                f"{want['step']} ({_AGAIN})")
    if ident.get("config_digest") != want["config_digest"]:
        raise CheckpointCorrupt(f"{mpath} was saved with another configuration (digest "
                                f"{ident.get('config_digest')}, {path}: "
                                f"{want['config_digest']}) ({_AGAIN})")
    for name, sha in unit["shards"]["files"].items():
        f = os.path.join(root, name)
        try:
            got = _sha256(f)
        except OSError as e:
            raise CheckpointCorrupt(f"{f} cannot be read ({e.strerror or e}): the checkpoint's "
                                    f"shard directory is incomplete ({_AGAIN})") from None
        if got != sha:
            raise CheckpointCorrupt(f"{f} does not match its checksum (SHA-256 recorded in "
                                    f"{path}): flipped bytes, or a file of another checkpoint "
                                    f"({_AGAIN})")
        if name != MANIFEST:
            _load_shard(f)


def _load_shard(f: str) -> None:
    """A shard file is data (weights only, memory-mapped: its tensors are not read)."""
    try:
        safe_load(f, f"shard file {f}", mmap=True)
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorrupt(f"{f} is unreadable ({type(e).__name__}: {e}) "
                                f"({_AGAIN})") from None


def read_unit(path: str) -> dict | None:
    """The verified header of the checkpoint at ``path`` (None: there is none).

    Every byte of ``checkpoint.pt`` and of its shard directory is checked first (see the
    module docstring); the header holds :data:`HEADER_KEYS` and ``run_id`` (None
    for a checkpoint of format 2).
    """
    if not os.path.exists(path):
        return None
    verify(path)
    try:
        state = safe_load(path, f"checkpoint {path}", mmap=True)
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorrupt(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                                "it may be truncated or from another program") from None
    check_fields(path, state)
    verify_shards(os.path.dirname(path) or ".", path, state)
    header = {k: state.get(k) for k in HEADER_KEYS}
    header["run_id"] = (state.get("unit") or {}).get("run_id")
    return header
