"""Fault injection for testing recovery: an object handed to the loop, not a global.

Following torchft's style (a failure injector passed to the trainer), a
:class:`FaultInjector` lists which rank fails at which step and how; the loop
asks it at two points -- during a step (:meth:`FaultInjector.at_step`) and in
the middle of a checkpoint save (:meth:`FaultInjector.at_save`) -- and knows
nothing else about it. Only the edges build one from text: ``gradsync train``
and ``torchrun -m gradsync.train`` read ``GRADSYNC_FAULT``.

``GRADSYNC_FAULT`` is a comma-separated list of ``RANK:STEP:KIND[@ATTEMPT]``:
``STEP`` counts the steps completed before the fault (so ``1:4:raise`` fails
during the 5th step, the 0-based loop index), ``RANK`` may be ``*`` (every rank),
and ``@ATTEMPT`` picks the launcher's restart (``TORCHELASTIC_RESTART_COUNT``) it
fires in, ``0`` (the first launch) when absent -- so under ``torchrun
--max-restarts N`` a fault does not fire again in the restarted workers.

Kinds: ``raise`` (a Python exception), ``exit`` (``os._exit(7)``), ``kill``
(SIGKILL: no cleanup at all), ``perturb`` (nudge this rank's first parameter, so
its replica drifts), ``nan`` (this rank's loss becomes NaN), ``kill-in-save``
(SIGKILL after this rank wrote its part of the checkpoint at that step, before the
checkpoint is made current), ``kill-in-heal`` (across replica groups: SIGKILL when this
rank has received a live peer's state to continue from that step, before loading it),
``stop`` (every rank saves a checkpoint after that
step and returns: a clean preemption), ``eio`` / ``enospc`` (rank 0's write of that
step's ``metrics.jsonl`` line fails halfway with an I/O error / a full disk: the
seam for a disk failure that cannot be produced for real without root).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

from ...errors import UsageError

FAULT_ENV = "GRADSYNC_FAULT"
KINDS = ("raise", "exit", "kill", "perturb", "nan", "kill-in-save", "kill-in-heal", "stop",
         "eio", "enospc")
_WRITE_ERRORS = {"eio": errno.EIO, "enospc": errno.ENOSPC}


class InjectedFault(RuntimeError):
    """What ``raise`` raises."""


@dataclass(frozen=True)
class Fault:
    rank: int | None  # None: every rank
    step: int  # 1-based: the step being taken, as in metrics.jsonl
    kind: str
    attempt: int = 0


@dataclass
class FaultInjector:
    """Which rank fails at which step, and how. Empty: nothing ever fails."""

    faults: list[Fault] = field(default_factory=list)
    attempt: int = 0

    def fail_at(self, rank: int | None, step: int, kind: str = "raise",
                attempt: int = 0) -> FaultInjector:
        """Make ``rank`` (None: every rank) fail during step ``step`` (1-based)."""
        if kind not in KINDS:
            raise UsageError(f"fault kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if step < 1:
            raise UsageError(f"a fault's step is 1-based, got {step}")
        self.faults.append(Fault(rank, int(step), kind, int(attempt)))
        return self

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _due(self, rank: int, step: int, kinds: tuple[str, ...]) -> Fault | None:
        for f in self.faults:
            if (f.step == step and f.kind in kinds and f.attempt == self.attempt
                    and f.rank in (None, rank)):
                return f
        return None

    # ------------------------------------------------------------ asked by the loop
    def at_step(self, rank: int, step: int, module=None) -> bool:
        """During step ``step``, before its last micro-batch. True: poison the loss (nan)."""
        f = self._due(rank, step, ("raise", "exit", "kill", "perturb", "nan"))
        if f is None:
            return False
        _say(f, rank)
        if f.kind == "raise":
            raise InjectedFault(f"injected fault on rank {rank} at step {step}")
        if f.kind == "exit":
            os._exit(7)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "perturb" and module is not None:
            with torch.no_grad():
                next(module.parameters()).view(-1)[0] += 1e-3
        return f.kind == "nan"

    def at_save(self, rank: int, step: int) -> None:
        """Mid-save: this rank's part is written, the checkpoint is not yet current."""
        f = self._due(rank, step, ("kill-in-save",))
        if f is not None:
            _say(f, rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def at_heal(self, rank: int, step: int) -> None:
        """A peer's state received (``--ft-group``), to take step ``step`` next; not loaded."""
        f = self._due(rank, step, ("kill-in-heal",))
        if f is not None:
            _say(f, rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def write_error(self, rank: int, step) -> int | None:
        """The errno the metrics line of ``step`` fails with on ``rank``, if one is due."""
        f = self._due(rank, step, tuple(_WRITE_ERRORS)) if isinstance(step, int) else None
        if f is None:
            return None
        _say(f, rank)
        return _WRITE_ERRORS[f.kind]

    def stop_after(self, step: int) -> bool:
        """True: every rank checkpoints after ``step`` and returns (a clean preemption)."""
        return self._due(0, step, ("stop",)) is not None

    # ------------------------------------------------------------ built at the edges
    @classmethod
    def parse(cls, text: str, attempt: int = 0) -> FaultInjector:
        inj = cls(attempt=attempt)
        for item in filter(None, (s.strip() for s in text.split(","))):
            spec, _, at = item.partition("@")
            parts = spec.split(":")
            if len(parts) != 3:
                raise UsageError(f"{FAULT_ENV}: expected RANK:STEP:KIND[@ATTEMPT], got {item!r}")
            try:
                rank = None if parts[0] == "*" else int(parts[0])
                inj.fail_at(rank, int(parts[1]) + 1, parts[2], int(at) if at else 0)
            except ValueError:
                raise UsageError(f"{FAULT_ENV}: RANK, STEP and ATTEMPT are integers, "
                                 f"got {item!r}") from None
        return inj

    @classmethod
    def from_env(cls, environ=None) -> FaultInjector:
        env = os.environ if environ is None else environ
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        return cls.parse(env.get(FAULT_ENV, ""), attempt)


def _say(f: Fault, rank: int) -> None:
    """One line with a wall-clock time, so a test can measure recovery from it."""
    print(f"gradsync: injected fault {f.kind} on rank {rank} at step {f.step} "
          f"(attempt {f.attempt}, t={time.time():.3f})", file=sys.stderr, flush=True)
