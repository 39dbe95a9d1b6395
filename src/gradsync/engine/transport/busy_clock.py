"""BusyClock: how long this process computed, as opposed to waited on other ranks.

A rank's step time says little about its own speed in a synchronous step: the
fast ranks spend the difference blocked in a collective, waiting for the slow
one. Wall time minus the time blocked in collectives (every collective passes
``comm``'s one door, which reports each wait) is what this rank itself needed --
the figure a straggler balancer compares across ranks.

Blocked means: on the CPU the host's wait; on a GPU the compute stream's stall, timed
by CUDA events around the wait (the host returns from a NCCL wait at once, so its clock
would measure enqueueing). Events are read without blocking: a stall whose events have
not completed when the clock is read counts at a later reading. The one sum of blocked
time in gradsync: ``observe/metrics.StepMeter`` is a BusyClock that also counts bytes.
"""

from __future__ import annotations

import time

from . import comm


class BusyClock:
    """``start()``, then ``busy_s()``: seconds since the start not spent blocked in collectives.

    Registers a ``comm`` observer for its lifetime; ``close()`` (or ``with``)
    removes it.
    """

    def __init__(self):
        self._blocked = 0.0  # every wait read so far, since the clock was made
        self._unread: list[comm.CollectiveEvent] = []  # GPU stalls not timed yet
        self._t0 = time.perf_counter()
        self._blocked0 = 0.0
        self._handle = comm.add_observer(self._on_comm)

    def _on_comm(self, kind: str, ev: comm.CollectiveEvent) -> None:
        if kind == "complete":
            if ev.gpu_wait is None:
                self._blocked += ev.waited_s
            else:
                self._unread.append(ev)
            self.completed(ev)

    def completed(self, ev: comm.CollectiveEvent) -> None:
        """Called for every collective that completed (a subclass counts what it needs)."""

    @property
    def blocked_total_s(self) -> float:
        """Seconds blocked in collectives since the clock was made (GPU stalls once their
        events are complete)."""
        waiting = []
        for ev in self._unread:
            s = ev.stream_wait_s()
            if s is None:
                waiting.append(ev)
            else:
                self._blocked += s
        self._unread = waiting
        return self._blocked

    def start(self) -> None:
        self._t0, self._blocked0 = time.perf_counter(), self.blocked_total_s

    @property
    def blocked_s(self) -> float:
        """Seconds blocked in collectives since :meth:`start`."""
        return self.blocked_total_s - self._blocked0

    def busy_s(self) -> float:
        wall = time.perf_counter() - self._t0
        return max(0.0, wall - self.blocked_s)

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self) -> BusyClock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
