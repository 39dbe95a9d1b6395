"""Second forkserver preload: the environment the forkserver started with, kept.

Workers fork from a forkserver started at a process's first launch, so they inherit
*that* moment's environment; each launch sends the caller's current one along and
the worker applies it first (``gradsync.launch``). Applying it with ``update`` alone
kept every variable the caller has removed since: a test that set
``GRADSYNC_NCCL_RULES`` (or a user's script that set and then unset a fault
injection or a tracker variable) around its first launch left it set in every later
worker of that process. The forkserver records its startup keys here, before torch
is imported (torch adds ``TORCHINDUCTOR_CACHE_DIR`` of its own, which must stay),
and :func:`become` removes those the caller no longer has.
"""

from __future__ import annotations

import os
from collections.abc import Callable

STARTUP_KEYS = frozenset(os.environ)


def become(caller: dict[str, str], set_by_agent: Callable[[str], bool]) -> None:
    """Make this worker's environment the caller's: drop the forkserver's startup keys
    the caller no longer has (except those the agent set for this worker), then apply
    the caller's values."""
    for key in STARTUP_KEYS - caller.keys():
        if not set_by_agent(key):
            os.environ.pop(key, None)
    os.environ.update(caller)
