"""Shared test set-up: single-threaded torch, short collective timeouts.

Multi-process tests use gradsync.spawn with a collective timeout, and pytest-timeout
(pyproject: 300 s default) backs that up: a hang is a failure, never a stuck CI.
"""

import os

import torch

os.environ.setdefault("GRADSYNC_TIMEOUT_S", "60")
torch.set_num_threads(1)
