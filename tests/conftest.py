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
