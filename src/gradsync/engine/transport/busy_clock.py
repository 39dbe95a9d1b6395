"""BusyClock: how long this process computed, as opposed to waited on other ranks.

A rank's step time says little about its own speed in a synchronous step: the
fast ranks spend the difference blocked in a collective, waiting for the slow
one. Wall time minus the time blocked in collectives (every collective passes
``comm``'s one door, which reports each wait) is what this rank itself needed --
the figure a straggler balancer compares across ranks.
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
        self._blocked = 0.0
        self._t0 = time.perf_counter()
        self._blocked0 = 0.0
        self._handle = comm.add_observer(self._on_comm)

    def _on_comm(self, kind: str, ev: comm.CollectiveEvent) -> None:
        if kind == "complete":
            self._blocked += ev.waited_s

    def start(self) -> None:
        self._t0, self._blocked0 = time.perf_counter(), self._blocked

    def busy_s(self) -> float:
        wall = time.perf_counter() - self._t0
        return max(0.0, wall - (self._blocked - self._blocked0))

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self) -> BusyClock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
