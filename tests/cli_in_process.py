"""`gradsync` commands run in the test's own process, for checks that read only the
exit code and what the command's own process prints.

A real command (``subprocess.run([python, "-m", "gradsync.cli", ...])``) costs a new
interpreter's torch import and its own forkserver (another torch import, with
torch._dynamo): 10-25 s a run on this 2-core machine under the suite's load, most
of it before the first step. Through ``gradsync.cli.main`` here, the workers fork
from this process's forkserver, already warm. What is lost: the workers' own
output (they write to the forkserver's stdout and stderr, set before the capture),
so a check that reads a worker's line, or that no worker printed a traceback,
stays a real command; every file that keeps such checks keeps at least one.
"""

from __future__ import annotations

import subprocess

import pytest

from gradsync.cli import main as cli_main


def cli_here(*args: str, capfd, env: dict | None = None) -> subprocess.CompletedProcess:
    """``gradsync ARGS`` through ``gradsync.cli.main``: the exit code (argparse's own
    refusals included) and the command process's stdout and stderr. ``env`` holds for
    this run only (the workers take the caller's environment at each launch)."""
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as m:
        for k, v in (env or {}).items():
            m.setenv(k, v)
        try:
            code = cli_main(list(args))
        except SystemExit as e:
            code = e.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["gradsync", *args], code, out, err)
