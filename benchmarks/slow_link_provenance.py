"""Where slow-link figures come from: the code's commit, the date, the machine's load.

A table mixing runs of different code says nothing about either, so every run is
stamped with the commit of the code that produced it and a results file holds one
commit only: ``slow_link.py`` refuses to add runs of another commit to it (start a new
one with ``--fresh``, which keeps the old file beside it), and the renderer refuses
to draw a run stamped otherwise.

"The code" is what decides a run's figures: ``src/`` (the engine and `gradsync
train`), ``benchmarks/`` (the runner, its worker and methods) and the pinned
dependencies. A commit that only edits documentation leaves it unchanged, so the
docs describing a run can be committed after it. Uncommitted changes to those paths
make the stamp ``<commit>+dirty:<hash of the diff>``: reproducible only from that
working tree, and never equal to a clean run's.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ["src", "benchmarks", "pyproject.toml", "constraints.txt"]


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"slow_link.py stamps runs with the code's git commit: "
                         f"git {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def code_commit() -> str:
    """The last commit that touched the code, plus a hash of uncommitted changes to it."""
    commit = _git("log", "-1", "--format=%H", "--", *CODE).strip()
    diff = _git("diff", "HEAD", "--", *CODE)
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *CODE)
    if not (diff or untracked.strip()):
        return commit
    h = hashlib.sha256(diff.encode())
    for name in sorted(untracked.split()):
        h.update(name.encode() + (ROOT / name).read_bytes())
    return f"{commit}+dirty:{h.hexdigest()[:12]}"


def machine() -> str:
    return (f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def load() -> float:
    return round(os.getloadavg()[0], 2)


def start(results: dict, fresh: bool, path: Path) -> dict:
    """The results to add to: ``results`` if it is this commit's (or empty), else a refusal
    -- or, with ``fresh``, an empty file (the old one kept as results-<commit>.json)."""
    commit = code_commit()
    old = results.get("provenance", {}).get("commit") or (
        "unknown-commit" if results else None)  # the single-seed files carried none
    if old and old != commit:
        if not fresh:
            raise SystemExit(
                f"{path} holds runs of commit {old[:12]}, and the code is now at "
                f"{commit[:12]}{' (uncommitted changes)' if '+dirty' in commit else ''}: "
                "runs of different code are never merged into one table. Rerun into a new "
                "--out, or pass --fresh to start this file over (the old one is kept).")
        keep = path.with_name(f"results-{old[:12].replace('+', '-')}.json")
        path.rename(keep)
        print(f"kept the runs of {old[:12]} as {keep}")
        results = {}
    if not results:
        results = {"provenance": {"commit": commit, "started": now(), "machine": machine()},
                   "runs": {}}
    return results
