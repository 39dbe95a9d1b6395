"""Start the workers' forkserver at a launch, with Ctrl-C kept from its startup.

The forkserver imports torch and torch._dynamo before it can fork a worker: about
5 s of a 2-core machine, every ``gradsync train``. Starting it at the CLI's first
line, so that its import overlapped the CLI's, was tried and reverted: a Ctrl-C
0.05 s into the command then landed in importlib's module-lock callback outside
the SIGINT hold, was ignored, and the run went on. Torch-free on purpose.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver as forkserver
import multiprocessing.resource_tracker as resource_tracker
import signal

# Imported once in the forkserver, so each worker forks with them loaded. torch._dynamo
# is what torch.optim.Optimizer.__init__ imports on first use: measured 2-8 s per worker
# on this 2-core machine under load, every launch, when left to the workers. SIGINT is
# quiet around them (gradsync.forkserver): a Ctrl-C there printed torch's import traceback.
PRELOAD = ["gradsync.forkserver.exit_on_sigint", "gradsync.forkserver.startup_environ",
           "torch", "torch.distributed", "torch._dynamo",
           "gradsync.launch", "gradsync.forkserver.restore_sigint"]

_preloaded = False


def ensure_running() -> None:
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
    global _preloaded
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
