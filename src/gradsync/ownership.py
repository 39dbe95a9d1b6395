"""Directories gradsync writes into are its own, or handed over with ``--overwrite``.

gradsync's files have common names -- ``config.json``, ``metrics.jsonl``,
``model.safetensors`` -- and another tool's directory, or a colleague's, holds files
of the same names: writing there silently replaces someone's work. So a command
that writes asks first whether the directory is gradsync's:

* it does not exist yet, or is empty (gradsync's own temporary files aside);
* it holds gradsync's marker, a small JSON file whose ``format`` names what the
  directory is (a run directory: ``gradsync-run.json``, written when a run first
  takes it; an export: ``gradsync-export.json``, the export's provenance);
* or the caller recognises it another way (a run directory of a gradsync from before
  the marker, by its checkpoint or its configuration: ``train/checkpoint/guard.py``).

Anything else is refused in one line naming what is there, before anything is
written, with ``--overwrite`` as the way on: then gradsync's files replace any of
the same names, and the others are left alone. This protects against accidents, not
attackers: whoever can write a directory can write a marker too (what a file can
do *when read* is :mod:`gradsync.safeload`'s business). Torch-free, bottom layer.
"""

from __future__ import annotations

import os

from .atomic import TMP_PREFIX
from .errors import UsageError
from .runfiles import read_json, write_json


def entries(directory: str) -> list[str]:
    """The names in ``directory`` (sorted), gradsync's own temporary files left out;
    [] when it does not exist."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.startswith(TMP_PREFIX))


def marked(directory: str, marker: str, fmt: str) -> bool:
    """Whether ``directory/marker`` is gradsync's marker of format ``fmt``."""
    value = read_json(os.path.join(directory, marker))
    return isinstance(value, dict) and value.get("format") == fmt


def mark(directory: str, marker: str, fmt: str, **fields) -> None:
    """Write the marker (atomically; a StorageError names it if the disk refuses)."""
    write_json(os.path.join(directory, marker), {"format": fmt, **fields}, indent=1,
               what="the directory's marker")


def refusal(directory: str, found: list[str], advice: str, writes: str) -> UsageError:
    """One line: what ``directory`` holds, that gradsync writes only into its own
    directories, ``advice`` (another directory) and what ``--overwrite`` would do."""
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return UsageError(f"{directory} holds files gradsync did not write ({shown}); gradsync "
                      f"writes only into directories of its own: {advice}, or pass --overwrite "
                      f"to write {writes} there (files of the same names are replaced, the "
                      "others left as they are)")
