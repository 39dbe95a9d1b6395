"""Emulated stragglers: a worker made slow on purpose, to try and to test ``--balance``.

``--straggler 1:0.5@20`` runs rank 1 at half speed from step 20 on. After each
micro-batch's forward and backward the slow rank sleeps ``(1/SPEED - 1)`` times
the *busy* time of that micro-batch (its wall time minus the time it was blocked
in collectives), so its compute -- and only its compute -- takes ``1/SPEED`` as
long, whatever the share it was handed. That is a throttled core, a noisy
neighbour or an older node as the other ranks see it: they wait for it.

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


class Slowdown:
    """This rank's emulated slowness: :meth:`after_micro_batch` sleeps when it applies."""

    def __init__(self, stragglers, rank: int):
        """``stragglers``: ``--straggler`` parsed (:func:`parse_stragglers`, when the config
        was resolved; ``config/plan.py`` checked its ranks against the workers)."""
        mine = [s for s in stragglers if s.rank == rank]
        self.stragglers = sorted(mine, key=lambda s: s.from_step)
        self._clock = BusyClock() if self.stragglers else None

    def speed(self, step: int) -> float:
        """This rank's emulated speed at ``step`` (the latest straggler entry in force)."""
        now = [s.speed for s in self.stragglers if s.from_step <= step]
        return now[-1] if now else 1.0

    def before_micro_batch(self) -> None:
        if self._clock is not None:
            self._clock.start()

    def after_micro_batch(self, step: int) -> None:
        speed = self.speed(step) if self._clock is not None else 1.0
        if speed >= 1.0:
            return
        time.sleep(self._clock.busy_s() * (1.0 / speed - 1.0))

    def close(self) -> None:
        if self._clock is not None:
            self._clock.close()
