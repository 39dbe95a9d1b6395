"""Shared test set-up: single-threaded torch, short collective timeouts.

Multi-process tests use gradsync.spawn with a collective timeout, and pytest-timeout
(pyproject: 300 s default) backs that up: a hang is a failure, never a stuck CI.
"""

import os

import torch

os.environ.setdefault("GRADSYNC_TIMEOUT_S", "60")
torch.set_num_threads(1)

# The suite runs on three pytest-xdist workers, a file at a time (pyproject: -n 3
# --dist loadfile): most tests wait on processes, sockets and timeouts rather than
# compute (a serial run used 15.7 CPU-minutes in 22 wall-minutes on 2 cores; at
# -n 2, 742 tests used 21 CPU-minutes in 18.9 wall-minutes, 1.1 of the 2 cores), so
# a third file at a time fills the idle core. Every test passed at a load average
# of 6-8 (a full run beside five other jobs), which is what a third worker risks.
# Scheduling the longest files first was tried and was slower (16.9 against 15.5
# minutes at -n 2): the heavy runs then overlap.
