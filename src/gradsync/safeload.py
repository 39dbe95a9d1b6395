"""The one way gradsync reads a torch file: as data, never as code.

``torch.load`` unpickles, and a pickle may name any function for the unpickler to
call: a ``checkpoint.pt`` with one crafted key runs its payload on whoever loads it.
A run directory may come from someone else -- a colleague's run on a shared disk, a
downloaded one to export -- and whoever wrote a file also wrote its checksums (the
zip's CRC-32s, the unit's and the manifest's SHA-256s), so no checksum stops that:
they detect damage, not tampering (docs/integrity.md). So every checkpoint, shard
and export read goes through :func:`load`:

* ``torch.load(weights_only=True)``: torch's restricted unpickler, which rebuilds
  tensors, storages, numbers, strings, containers, ``OrderedDict``, dtypes and devices
  and refuses any other global before calling anything. Everything gradsync itself
  writes (ddp, ZeRO 1-3 and their shards, bf16 masters, DiLoCo and streaming state,
  int8 and PowerSGD residuals, the balancer, the RNG state) is made of those, so
  :data:`GRADSYNC_TYPES`, the allow-list beyond torch's own, is empty; a test saves
  every strategy's checkpoint and loads it through here.
* a refusal is one :class:`~gradsync.errors.UnsafeFileError` naming the file and what
  its pickle names, never torch's multi-line advice to set ``weights_only=False``.
* the one way past it is the user's, asked for by name: ``--trust-checkpoint-code``
  (``TrainConfig.trust_checkpoint_code``), for a checkpoint they wrote themselves whose
  optimizer or scheduler state holds their own types -- named after transformers'
  ``trust_remote_code``. It holds inside :func:`trusting`, a scope the commands open
  around their reads (as torch's own ``safe_globals`` is a scope), so the engine's shard
  loader deep below takes no flag. Outside a scope, and in any thread started inside
  one (a ``ContextVar`` is not inherited by threads), a file is data only.

Tensors load on ``map_location`` ("cpu" unless the caller passes the current device).
The weights-only unpickler is itself the trusted part: torch before 2.6 could be made
to run code through it (CVE-2025-32434), so gradsync requires torch >= 2.6.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import re
import warnings

import torch

from .errors import UnsafeFileError

GRADSYNC_TYPES: tuple = ()
"""Globals gradsync's own files need beyond torch's weights-only set: none (see above)."""

TRUST_FLAG = "--trust-checkpoint-code"

_TRUST: contextvars.ContextVar[bool] = contextvars.ContextVar("gradsync_trust_checkpoint_code",
                                                                default=False)


@contextlib.contextmanager
def trusting(trust: bool = True):
    """Inside: :func:`load` unpickles in full when ``trust`` (the user's explicit opt-in)."""
    token = _TRUST.set(bool(trust))
    try:
        yield
    finally:
        _TRUST.reset(token)


def trusted() -> bool:
    """Whether the current scope was opened with ``trusting(True)``."""
    return _TRUST.get()


def _reason(message: str) -> str:
    """What torch's weights-only unpickler refused, in a few words."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    if m:
        return f"unpickling it would import and call {m.group(1)}"
    m = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", message, re.S)
    said = " ".join((m.group(1) if m else message.splitlines()[0]).split())
    return f"its pickle needs more than tensors and plain data ({said.rstrip('.')})"


def refusal(name: str, why: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{name} was not loaded: {why}, and gradsync never runs code from a file (its own "
        f"files hold only tensors and plain data, so this one was altered or written by "
        f"another program); if you wrote it yourself and trust it, pass {TRUST_FLAG}")


def load(source, name: str, *, map_location="cpu", mmap: bool = False):
    """``torch.load`` of ``source`` (a path, or a file object of bytes) as data only.

    ``name`` says which file it is in messages ("checkpoint runs/a/checkpoint.pt").
    Raises :class:`UnsafeFileError` (one line) for anything but data; other failures
    (a truncated zip, not a torch file at all) are raised as torch raises them, for
    the caller to name as damage.
    """
    if _TRUST.get():
        return torch.load(source, map_location=map_location, weights_only=False, mmap=mmap)
    allow = (torch.serialization.safe_globals(list(GRADSYNC_TYPES)) if GRADSYNC_TYPES
             else contextlib.nullcontext())
    try:
        with allow, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise refusal(name, _reason(str(e))) from None
    except RuntimeError as e:
        if "TorchScript" not in str(e):
            raise
        raise refusal(name, "it is a TorchScript archive, a program rather than data") from None
