"""Workers die with the launcher that started them.

A launcher killed with SIGKILL (the OOM killer, a scheduler's hard stop, ``kill -9``)
cannot stop its workers: they are re-parented and go on training, writing metrics
and checkpoints into a run directory whose lock died with the launcher, so a rerun
takes the lock over and two jobs train on one directory. The parent-death signal
(``PR_SET_PDEATHSIG``) does not help here: workers fork from a forkserver, which
outlives the launcher as long as any worker holds its "alive" pipe, and every
worker does. So each worker watches the launcher's process itself: a daemon thread
waits on a pidfd of the launcher (``os.pidfd_open``, Linux 5.3+; elsewhere it polls
every half second) and SIGKILLs its own process when the launcher is gone.
Checkpoints are written atomically and stale temporary files are removed at the
next start, so a worker killed mid-save loses nothing.

Not used under torchrun (``python -m gradsync.train``): there the workers' parent
is torchrun's agent, whose own shutdown stops them.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time


def die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` exits (at once if it already has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # a pidfd becomes readable when the process exits
        else:
            while _alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="gradsync-lifeline", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
