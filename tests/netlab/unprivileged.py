"""Running this checkout's Python as 'nobody', and telling why that cannot work here.

The no-root test drops root with ``setpriv`` and runs ``sys.executable -c ...``,
which must import the very ``gradsync`` under test. A checkout (or a virtual
environment) below a directory closed to others -- a clone in a 0700 temporary
directory, anything under a private ``/root`` -- is out of an unprivileged user's
reach: its import then fails, or quietly finds another ``gradsync`` (the editable
install's, when the tests run from a clone through ``PYTHONPATH``). ``probe``
finds out by doing it, and names the path component that is closed, so the test
can skip for exactly that reason and fail for any other.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import gradsync

NOBODY = 65534
DROP = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
# [ -x dir ] / [ -r file ] as nobody; a component below a closed one fails too, so the
# first path printed (ancestors come first) is the one that shuts the rest out
_CLOSED = ('for p; do if [ -d "$p" ]; then [ -x "$p" ] || echo "$p"; '
           'else [ -r "$p" ] || echo "$p"; fi; done')
# how an import or an exec fails on a path it may not read (anything else is a real error)
_UNREACHABLE = ("ModuleNotFoundError", "PermissionError", "Permission denied",
                "failed to execute", "No module named")


def as_unprivileged(cmd: list[str]) -> list[str]:
    """``cmd`` as 'nobody' when we are root (then ``setpriv`` must exist), else as is."""
    return [*DROP, *cmd] if os.geteuid() == 0 else list(cmd)


def _with_ancestors(path: Path) -> list[str]:
    return [str(p) for p in reversed(path.parents)] + [str(path)]


def closed_to_others(paths: list[Path]) -> list[str]:
    """The components of ``paths`` (and of their ancestors) 'nobody' cannot enter or read."""
    todo = list(dict.fromkeys(c for p in paths for c in _with_ancestors(p)))
    r = subprocess.run(as_unprivileged(["sh", "-c", _CLOSED, "sh", *todo]),
                       capture_output=True, text=True, timeout=60, cwd="/")
    return r.stdout.split()


def _mode(path: str) -> str:
    st = os.stat(path)
    return f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}"


def probe(env: dict, cwd: Path) -> str | None:
    """None if the unprivileged ``sys.executable`` imports this same ``gradsync``;
    otherwise why not, naming the closed path. A failure that no closed path explains
    (an import error of another kind, or every path open) raises AssertionError: that
    is a broken import, which the test must not hide behind a skip."""
    mine = str(Path(gradsync.__file__).resolve())
    r = subprocess.run(as_unprivileged([sys.executable, "-c", "import gradsync.cli; "
                                        "print(gradsync.__file__)"]),
                       capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    seen = r.stdout.strip()
    if r.returncode == 0 and seen and str(Path(seen).resolve()) == mine:
        return None
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    what = f"imports {seen}, not {mine}" if r.returncode == 0 else f"fails: {last}"
    assert r.returncode == 0 or any(w in last for w in _UNREACHABLE), (
        f"an unprivileged {sys.executable} {what}\n{r.stderr[-3000:]}")
    # what finding gradsync reads: its directory, the venv's site-packages (editable .pth);
    # for any other failure, also what starting the interpreter reads
    reads = [Path(mine).parent, Path(sys.prefix)]
    if r.returncode != 0 and "gradsync" not in last:
        reads += [Path(os.path.realpath(sys.executable)), Path(sys.base_prefix)]
    closed = closed_to_others(reads)
    assert closed, f"an unprivileged {sys.executable} {what}, yet every path is open to it"
    return (f"an unprivileged user cannot use this checkout: as uid {NOBODY}, {sys.executable} "
            f"{what}, because {closed[0]} ({_mode(closed[0])}) is closed to others")
