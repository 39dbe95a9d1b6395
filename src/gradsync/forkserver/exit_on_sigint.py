"""First forkserver preload: a SIGINT while the preload imports run ends the forkserver quietly.

Exiting (rather than ignoring the signal) keeps what Ctrl-C did before: the
forkserver is gone, so no worker is forked for a launcher that is already
shutting down (such a late worker fails unpickling the launcher's released
semaphores and prints a traceback of its own).
"""

import os
import signal
import sys
import traceback


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _exit_quietly)
# the launcher started this process with SIGINT blocked (gradsync.launch): a Ctrl-C
# during interpreter startup is pending, and ends the forkserver here, quietly
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _quiet_when_the_launcher_left(exc_type, exc, tb, _default=sys.excepthook) -> None:
    """A worker forked after its launcher was interrupted (SIGINT sent to the launcher's
    pid alone, so this forkserver kept serving) cannot rebuild the launcher's released
    semaphores: that FileNotFoundError means "nobody is waiting for me", and the worker
    ends without a traceback under the launcher's one-line message."""
    if isinstance(exc, FileNotFoundError) and any(
            frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "synchronize.py"))
            for frame, _line in traceback.walk_tb(tb)):
        return
    _default(exc_type, exc, tb)


sys.excepthook = _quiet_when_the_launcher_left  # the forkserver's children inherit it
