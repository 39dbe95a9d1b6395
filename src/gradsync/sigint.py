"""Ctrl-C that cannot be lost: held back while third-party code runs that would swallow it.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread happens
to be. Some code catches it there and carries on: ``import torch`` loads ``torch._C``,
whose C initialisation imports numpy and clears *any* exception that import raises
(it then warns "Failed to initialize NumPy"), so a Ctrl-C that lands during those
seconds of ``gradsync train``'s start-up vanished and the run trained to the end,
exit 0 (issue 22: 2 of about 50 interrupts). Likewise, while torch's elastic agent
runs, SIGINT raises its ``SignalException``, an ``Exception`` that any ``except
Exception`` on the way swallows.

:func:`held` blocks SIGINT for the calling thread (``pthread_sigmask``) around such
code: a Ctrl-C meanwhile stays pending in the kernel and is delivered the moment
the block ends, so it is raised in our code, where it is handled, and never inside
theirs. Blocking rather than ignoring loses nothing; the price is that the
interrupt waits for the held region to end (an import: a second or two).
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def held():
    """Hold SIGINT back for the body; one that arrived meanwhile is raised on leaving.

    Outside the main thread (where Python never runs signal handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def pending() -> bool:
    """Whether a SIGINT is waiting, held back by a block (this thread's or the process's)."""
    return signal.SIGINT in signal.sigpending()
