"""Blocking collectives run in order on one background thread, as overlapped work.

Reference algorithms (``algorithms/``), compressors (``compress/``) and Streaming
DiLoCo's fragment reductions block: they compute between their messages. To
overlap them with backward, as an async all-reduce overlaps, they run on a
communication thread. Two rules keep that safe: one thread per owner, so
operations are issued in submission order on every rank; and process groups no
other thread uses, because two threads issuing collectives on one group can order
them differently on different ranks (a mismatch, or a hang). :func:`private_group`
makes such a group.

On a GPU the thread also needs a device and a stream of its own. A new thread's
current device is GPU 0 and its current stream the default one: every collective
and every kernel it launched (the compressors' encoding, the sums) queued behind
the training stream's work on the default stream, and NCCL made the training
stream wait for it in turn, so nothing overlapped (and with several GPUs per host,
the thread worked on the wrong one). The thread here takes the submitting thread's
device and runs on its own stream: each call first waits for what the caller had
queued when it submitted (an event), and whoever collects the result waits for an
event recorded after the call, so values are ready where they are used without
blocking the host.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from ...dist import comm_device, default_timeout_s
from . import comm


def private_group(group=None):
    """A new process group with the ranks of ``group`` (only those ranks call this),
    with gradsync's collective timeout, opened by one collective of every rank
    (:func:`open_group`)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    grp = dist.new_group(ranks, timeout=timedelta(seconds=default_timeout_s()),
                         use_local_synchronization=True)
    open_group(grp)
    return grp


def open_group(group) -> None:
    """A first collective on a new group, every rank of it taking part.

    NCCL requires that a group's first ``batch_isend_irecv`` involve all its ranks
    (torch's documentation of it); the reference algorithms' first rounds (a tree's
    leaves, a parameter server's workers) do not. One small all-reduce here makes
    every later round a round on an opened group."""
    comm.all_reduce(torch.zeros(1, device=comm_device(group)), group, tag="open-group")


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


class Handoff:
    """A call running on the communication thread; :meth:`result` hands its result to
    the calling thread's stream (the host waits only for the thread, not the GPU)."""

    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self):
        """The call's return value (re-raises what it raised)."""
        value, finished = self._future.result()
        if finished is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(finished)
            for t in _tensors(value):  # made on the thread's stream, used on this one
                if t.is_cuda:
                    t.record_stream(stream)
        return value


class _FutureWork:
    """What ``comm.Pending`` needs from a work object, for a thread's call."""

    __slots__ = ("_handoff",)

    def __init__(self, handoff: Handoff):
        self._handoff = handoff

    def wait(self) -> None:
        self._handoff.result()

    def is_completed(self) -> bool:
        return self._handoff.done()


class CommThread:
    """Runs submitted blocking calls one at a time, in submission order."""

    def __init__(self, name: str = "gradsync-comm"):
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._device: int | None = None
        self._stream = None

    def _start(self) -> None:
        if _cuda_in_use():
            self._device = torch.cuda.current_device()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name,
                                        initializer=self._enter)

    def _enter(self) -> None:
        """First thing on the thread: the caller's GPU and a stream of its own."""
        if self._device is not None:
            torch.cuda.set_device(self._device)
            self._stream = torch.cuda.Stream(self._device)

    def run(self, fn, *args, **kwargs) -> Handoff:
        """Start ``fn(*args, **kwargs)`` after everything submitted before."""
        if self._pool is None:
            self._start()
        ready = None
        if self._device is not None:  # what the caller queued so far: fn's inputs
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())

        def call():
            if ready is None:
                return fn(*args, **kwargs), None
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                value = fn(*args, **kwargs)
                finished = torch.cuda.Event()
                finished.record(self._stream)
            return value, finished

        return Handoff(self._pool.submit(call))

    def submit(self, fn, *args, **kwargs) -> comm.Pending:
        """Start ``fn(*args, **kwargs)`` after everything submitted before; its
        ``wait()`` re-raises what ``fn`` raised."""
        return comm.Pending(_FutureWork(self.run(fn, *args, **kwargs)), None)

    def close(self) -> None:
        """Wait for what was submitted and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
