"""First forkserver preload: a SIGINT while the preload imports run ends the forkserver quietly.

Exiting (rather than ignoring the signal) keeps what Ctrl-C did before: the
forkserver is gone, so no worker is forked for a launcher that is already
shutting down (such a late worker fails unpickling the launcher's released
semaphores and prints a traceback of its own).
"""

import os
import signal


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _exit_quietly)
# the launcher started this process with SIGINT blocked (gradsync.launch): a Ctrl-C
# during interpreter startup is pending, and ends the forkserver here, quietly
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
