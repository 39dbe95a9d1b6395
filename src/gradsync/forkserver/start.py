"""Start the workers' forkserver, at a launch or ahead of it while the CLI starts up.

The forkserver imports torch and torch._dynamo before it can fork a worker: about
5 s of a 2-core machine, every ``gradsync train``. The CLI spends its own first
3 s importing torch and checking flags, and until now the forkserver started only
after that, so the two waits added up. :func:`early` starts it at the CLI's first
line, so both import at once; :func:`ensure_running` (each launch) then finds it
running. A command that ends without launching (a usage error, a finished run)
calls :func:`release_unused`, which stops it at once rather than let it finish
importing torch for nobody. Torch-free on purpose: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver as forkserver
import multiprocessing.resource_tracker as resource_tracker
import os
import signal

# Imported once in the forkserver, so each worker forks with them loaded. torch._dynamo
# is what torch.optim.Optimizer.__init__ imports on first use: measured 2-8 s per worker
# on this 2-core machine under load, every launch, when left to the workers. SIGINT is
# quiet around them (gradsync.forkserver): a Ctrl-C there printed torch's import traceback.
PRELOAD = ["gradsync.forkserver.exit_on_sigint", "torch", "torch.distributed", "torch._dynamo",
           "gradsync.launch", "gradsync.forkserver.restore_sigint"]

_preloaded = False
_unclaimed = False  # started by early() and not yet used by a launch


def ensure_running(claim: bool = True) -> None:
    """Start (or restart) the workers' forkserver with Ctrl-C kept from its startup.

    The forkserver runs in the caller's process group, so a terminal's Ctrl-C
    reaches it. Started with SIGINT *blocked* (the signal mask is inherited across
    fork and exec), its interpreter startup cannot print a KeyboardInterrupt
    traceback; its first preload module installs a quiet exit and unblocks, so a
    Ctrl-C that arrived meanwhile ends it there, and its last gives workers the
    default handler (``gradsync.forkserver``). Blocking rather than ignoring keeps
    the signal pending for the caller too: a Ctrl-C during the fork+exec itself is
    delivered (KeyboardInterrupt) as soon as the mask is restored, not lost.
    """
    global _preloaded, _unclaimed
    if claim:
        _unclaimed = False
    if not _preloaded:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _preloaded = True
    # The resource tracker first: starting it *unblocks* SIGINT (multiprocessing's own
    # block/unblock), which inside our block let the forkserver start with Ctrl-C live
    # and print an import traceback from its interpreter startup.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def early() -> None:
    """Start the forkserver now, for a launch that is expected to come.

    Call it outside any :func:`gradsync.sigint.held` region: starting the resource
    tracker unblocks SIGINT. If no launch follows, call :func:`release_unused`.
    """
    global _unclaimed
    running = forkserver._forkserver._forkserver_pid is not None
    ensure_running(claim=False)
    _unclaimed = _unclaimed or not running


def release_unused() -> None:
    """Stop a forkserver :func:`early` started that no launch used (nothing forked from it)."""
    global _unclaimed
    if not _unclaimed:
        return
    _unclaimed = False
    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # it may be seconds into importing torch
    with contextlib.suppress(OSError):
        server._stop()  # reaps it and forgets it, so a later launch starts a new one
