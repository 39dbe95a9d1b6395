"""Shared test set-up: single-threaded torch, short collective timeouts.

Multi-process tests use gradsync.spawn with a collective timeout, and pytest-timeout
(pyproject: 300 s default) backs that up: a hang is a failure, never a stuck CI.
"""

import os

import torch

os.environ.setdefault("GRADSYNC_TIMEOUT_S", "60")
torch.set_num_threads(1)

# The suite runs on two pytest-xdist workers, a file at a time (pyproject: -n 2
# --dist loadfile; most tests wait on processes, sockets and timeouts rather than
# compute, so two at once nearly halve the wall time on 2 cores). Files go out in
# collection order, so the files that take longest (measured: `--durations`) go
# first and the short ones fill in behind them, instead of one long file starting
# last and running alone.
SLOW_FIRST = (
    "tests/cli/test_train_cli.py", "tests/train/test_membership.py",
    "tests/train/test_user_model.py", "tests/train/test_guards.py",
    "tests/netlab/test_netlab.py", "tests/test_torchrun.py", "tests/cli/test_verify_cli.py",
    "tests/train/test_elastic.py", "tests/train/test_write_paths.py",
    "tests/cli/test_report_cli.py", "tests/train/test_balance_train.py",
    "tests/calibrate/test_links.py", "tests/test_slow_link_benchmark.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
