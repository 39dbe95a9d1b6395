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


# ------------------------------------------------------------------ a worker's stop
# A worker is stopped by more than one signal: a terminal's Ctrl-C reaches every
# process of the group (the worker, and the launcher whose elastic agent then sends
# the workers SIGINT again), and the agent stops the survivors of a failure with
# SIGTERM. The first raises KeyboardInterrupt, which unwinds the worker through its
# clean-up (the session's close: the trackers' own close, the lock). A second one
# raised there cut that clean-up short: W&B's run lost its last records and its
# exit, MLflow's stayed RUNNING (issue 37). So once a worker is stopping, further
# SIGINT/SIGTERM are noted and not raised; the agent still ends a worker that takes
# longer than its shutdown timeout (30 s) with SIGKILL.

_stop = {"stopping": False, "signal": None}


def _stop_handler(signum, frame) -> None:
    if _stop["stopping"]:
        return  # the stop is under way: the clean-up it runs must not be cut short
    _stop["stopping"], _stop["signal"] = True, signum
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def interrupt_once() -> dict:
    """SIGINT and SIGTERM raise KeyboardInterrupt once; later ones, while the process is
    stopping, are noted only. Returns the handlers it replaced (main thread only)."""
    _stop.update(stopping=False, signal=None)
    return {s: signal.signal(s, _stop_handler) for s in (signal.SIGINT, signal.SIGTERM)}


@contextlib.contextmanager
def stopping():
    """The body is the process's clean-up: a SIGINT/SIGTERM meanwhile (with
    :func:`interrupt_once`'s handlers) is noted, not raised into it."""
    before = _stop["stopping"]
    _stop["stopping"] = True
    try:
        yield
    finally:
        _stop["stopping"] = before


def stop_signal() -> int | None:
    """The signal that stopped this process (set by :func:`interrupt_once`'s handler)."""
    return _stop["signal"]
