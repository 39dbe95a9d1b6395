"""Emulated stragglers: a worker made slow on purpose, to try and to test ``--balance``.

``--straggler 1:0.5@20`` runs rank 1 at half speed from step 20 on. Between each
micro-batch's forward and its backward the slow rank sleeps ``(1/SPEED - 1)`` times
that micro-batch's compute -- its forward's *busy* time (wall time minus the time it
was blocked in collectives), measured, and its backward's, estimated from the
micro-batch before (the ratio of backward to forward it took; twice the forward for
the first) -- so its compute takes ``1/SPEED`` as long, whatever the share it was
handed. That is where a slow device is slow: before its gradient leaves. A sleep
after the backward (as this once was) came after the bucketed all-reduce had already
taken the gradient, so the other ranks waited at the next collective instead of at
the gradient's, and overlap hid part of the slowness a real slow device shows.
``benchmarks/stragglers_worker.py`` sleeps at the same point, between forward and
backward. That is a throttled core, a noisy neighbour or an older node as the other
ranks see it: they wait for it.

A sleep rather than a CPU quota: it needs no privileges, behaves the same on a
GPU node, and on a shared CPU machine it frees the core instead of competing
for it (so the fast ranks are not slowed by the emulation itself).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ...engine.transport.busy_clock import BusyClock
from ...errors import UsageError

_ONE = re.compile(r"^\s*(\d+)\s*:\s*([0-9.eE+-]+)\s*(?:@\s*(\d+))?\s*$")


@dataclass(frozen=True)
class Straggler:
    rank: int
    speed: float  # 0 < speed <= 1: the fraction of its normal speed
    from_step: int = 1


def parse_stragglers(text: str) -> list[Straggler]:
    """``RANK:SPEED[@STEP],...`` -> stragglers; a clear error naming the bad part."""
    out: list[Straggler] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = _ONE.match(part)
        try:
            speed = float(m.group(2)) if m else 0.0
        except ValueError:
            speed = 0.0
        if not m or not 0 < speed <= 1:
            raise UsageError(f"--straggler {part!r}: expected RANK:SPEED[@STEP] with 0 < SPEED "
                             "<= 1, e.g. 1:0.5@20 (rank 1 at half speed from step 20)")
        out.append(Straggler(int(m.group(1)), speed, int(m.group(3) or 1)))
    return out


def _settle() -> None:
    """On a GPU, wait for the work queued so far (a straggler rank only): the host returns
    from a kernel launch at once, so its clock would time the launches, not the compute."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class Slowdown:
    """This rank's emulated slowness: :meth:`before_backward` sleeps when it applies."""

    def __init__(self, stragglers, rank: int):
        """``stragglers``: ``--straggler`` parsed (:func:`parse_stragglers`, when the config
        was resolved; ``config/plan.py`` checked its ranks against the workers)."""
        mine = [s for s in stragglers if s.rank == rank]
        self.stragglers = sorted(mine, key=lambda s: s.from_step)
        self._clock = BusyClock() if self.stragglers else None
        self._forward_s = 0.0  # this micro-batch's forward, busy seconds
        self._ratio = 2.0  # backward / forward busy time, as the last micro-batch took them

    def speed(self, step: int) -> float:
        """This rank's emulated speed at ``step`` (the latest straggler entry in force)."""
        now = [s.speed for s in self.stragglers if s.from_step <= step]
        return now[-1] if now else 1.0

    def before_micro_batch(self) -> None:
        """The micro-batch's forward starts now."""
        if self._clock is not None:
            self._clock.start()

    def before_backward(self, step: int) -> None:
        """The forward is done, the backward (which sends the gradient) not started: sleep
        ``(1/speed - 1)`` times this micro-batch's compute, the forward's measured and the
        backward's estimated (module doc)."""
        if self._clock is None:
            return
        _settle()
        self._forward_s = self._clock.busy_s()
        speed = self.speed(step)
        if speed < 1.0:
            compute = self._forward_s * (1.0 + self._ratio)
            time.sleep(compute * (1.0 / speed - 1.0))
        self._clock.start()  # the backward's busy time, without the sleep

    def after_micro_batch(self, step: int) -> None:
        """The backward is done: its busy time against the forward's, for the next estimate."""
        if self._clock is None or self._forward_s <= 0:
            return
        _settle()
        self._ratio = self._clock.busy_s() / self._forward_s

    def close(self) -> None:
        if self._clock is not None:
            self._clock.close()
