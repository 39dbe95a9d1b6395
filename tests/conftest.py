"""Shared test set-up: single-threaded torch, short collective timeouts.

Multi-process tests use gradsync.spawn with a collective timeout, and pytest-timeout
(pyproject: 300 s default) backs that up: a hang is a failure, never a stuck CI.
"""

import os

import torch

os.environ.setdefault("GRADSYNC_TIMEOUT_S", "60")
torch.set_num_threads(1)

# The suite runs on three pytest-xdist workers, a file at a time (pyproject: -n 3
# --dist loadfile) on 2 cores: most tests wait on processes, sockets, restarts and
# timeouts rather than compute (a serial run used 15.7 CPU-minutes in 22 wall-minutes;
# with two workers the CI used 24.7 CPU-minutes in 22.8 wall-minutes, half of its two
# cores idle), so a third worker fills the waits. Scheduling the longest files first
# was tried and was slower (16.9 minutes): the heavy runs then overlap.


def pytest_configure(config):
    """Compile the project's sources once, before any worker starts.

    With ``PYTHONDONTWRITEBYTECODE`` set (it is on this machine) no process writes a
    ``.pyc``, so every ``gradsync train`` subprocess, its forkserver and each of its
    workers compiled the modules they import from source: about 0.9 s of CPU per
    2-worker launch (py-spy: ``source_to_code``), hundreds of launches in the suite.
    Python still reads ``.pyc`` files when it may not write them; compileall writes
    them regardless (about 1 s for ``src`` and ``tests``). In the controller only.
    """
    if hasattr(config, "workerinput"):
        return
    import compileall
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    for tree in ("src", "tests", "benchmarks", "examples"):
        if (root / tree).is_dir():
            compileall.compile_dir(str(root / tree), quiet=1)
