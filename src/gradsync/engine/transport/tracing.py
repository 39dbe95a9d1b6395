"""Span recording for one rank: what the engine did, when, as plain tuples.

Why it lives in the engine: only the engine knows when a backward starts, when
the end of backward starts waiting for buckets, and which collective is which
bucket. Why it is this small: it is off by default and the engine pays one
module-global check (``tracing.ACTIVE is not None``) per forward, backward and
sync when it is off -- no observer registered, no clock read, no allocation.
Turning spans into Chrome trace JSON, merging ranks and drawing them belongs to
``gradsync.observe`` (the engine never imports it).

Every collective is recorded through :mod:`gradsync.engine.transport.comm`'s observer
door, so ZeRO's gathers and scatters appear without ZeRO knowing about tracing.
A collective's span runs from launch to the backend's completion (the work's
future), which for an overlapped all-reduce is earlier than the wait that
finally consumes it; the wait itself is its own span on the compute lane.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from . import comm

now = time.perf_counter

ACTIVE: Tracer | None = None
"""The recording tracer, or None (the default): the engine's one check."""


@dataclass
class Span:
    """One interval on one rank; times are ``time.perf_counter()`` seconds."""

    name: str
    cat: str  # "step" | "compute" | "wait" | "comm"
    start: float
    end: float
    args: dict = field(default_factory=dict)


class Tracer:
    """Records spans on this rank while it is the active tracer.

    ``start()`` makes it active and observes collectives; ``stop()`` undoes both.
    Steps are marked with ``begin_step``/``end_step`` so every span carries the
    step it belongs to and each collective can be checked against its step.
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.spans: list[Span] = []
        self.step: int | None = None
        self.wall_offset = time.time() - time.perf_counter()  # perf -> epoch seconds
        self._events: list[tuple[comm.CollectiveEvent, int | None]] = []
        self._handle: comm.ObserverHandle | None = None
        self._step_start = 0.0

    # -------------------------------------------------------------- activation
    def start(self) -> Tracer:
        global ACTIVE
        if ACTIVE is not None and ACTIVE is not self:
            raise RuntimeError("another Tracer is already recording in this process")
        if self._handle is None:
            self._handle = comm.add_observer(self._on_comm)
        ACTIVE = self
        return self

    def stop(self) -> None:
        global ACTIVE
        if ACTIVE is self:
            ACTIVE = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._collect(final=True)

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -------------------------------------------------------------- recording
    def record(self, name: str, cat: str, start: float, end: float, **args) -> None:
        if self.step is not None:
            args.setdefault("step", self.step)
        self.spans.append(Span(name, cat, start, end, args))

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        t0 = now()
        try:
            yield
        finally:
            self.record(name, cat, t0, now(), **args)

    def begin_step(self, step: int) -> None:
        self.step = step
        self._step_start = now()

    def end_step(self) -> None:
        if self.step is None:
            return
        self._collect()
        self.record(f"step {self.step}", "step", self._step_start, now())
        self.step = None

    def _on_comm(self, kind: str, ev: comm.CollectiveEvent) -> None:
        if kind == "launch":
            self._events.append((ev, self.step))

    def _collect(self, final: bool = False) -> None:
        """Turn completed collectives into spans (end = backend completion, else wait)."""
        keep = []
        for ev, step in self._events:
            if ev.end is None and not final:
                keep.append((ev, step))
                continue
            end = ev.end if ev.end is not None else now()
            if ev.finished is not None:
                end = min(end, ev.finished)
            args = {"bytes": ev.nbytes, "tag": ev.tag, "waited_ms": ev.waited_s * 1e3, **ev.meta}
            if step is not None:
                args["step"] = step
            self.spans.append(Span(f"{ev.op} {ev.tag}".strip(), "comm", ev.start,
                                   max(end, ev.start), args))
        self._events = keep


def span(name: str, cat: str = "compute", **args):
    """``with tracing.span("optimizer"):`` -- records when a tracer is active, else nothing."""
    tracer = ACTIVE
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.span(name, cat, **args)


def wait_begins() -> float | None:
    """Start of a block on communication (None when no tracer is recording)."""
    return now() if ACTIVE is not None else None


def wait_ends(t0: float | None, name: str = "sync wait", **args) -> None:
    """Record the block that began at ``t0`` (a no-op when nothing is recording)."""
    if t0 is not None and ACTIVE is not None:
        ACTIVE.record(name, "wait", t0, now(), **args)
