"""Every collective the engine issues goes through here.

One narrow door for communication makes two things cheap: tests count
collectives with an observer instead of reading logs, and the tracer records
each collective from launch to completion without touching the engine. With no
observer registered the cost is one empty-list check per call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...dist import default_timeout_s
from . import flight_recorder, host


@dataclass
class CollectiveEvent:
    """A collective as observers see it.

    ``start``: launch; ``end``: when its wait returned; ``finished``: when the
    backend completed it (set from the work's future, so for an async all-reduce
    overlapped with backward it is the true end of communication, usually well
    before anyone waits); ``waited_s``: how long the caller was blocked on it (the
    whole duration for a synchronous call) -- the *exposed* part of its cost.
    """

    op: str
    nbytes: int
    tag: str
    start: float
    end: float | None = None
    waited_s: float = 0.0
    meta: dict = field(default_factory=dict)
    finished: float | None = None
    on_gpu: bool = False
    # on a GPU, wait() returns once the stream waits, so the host clock measures nothing:
    # CUDA events recorded around it on the stream; their gap is the stream's stall
    # (read by ``stream_wait_s`` once the events have completed)
    gpu_wait: tuple | None = None

    def stream_wait_s(self) -> float | None:
        """Seconds the compute stream stalled in this wait (GPU), None while its events
        are not complete yet (never blocks); the host's ``waited_s`` elsewhere."""
        if self.gpu_wait is None:
            return self.waited_s
        before, after = self.gpu_wait
        if not after.query():
            return None
        return before.elapsed_time(after) / 1e3


Observer = Callable[[str, CollectiveEvent], None]
"""Called with ("launch" | "complete", event)."""

_observers: list[Observer] = []


class ObserverHandle:
    """Removable registration, like torch's hook handles."""

    def __init__(self, fn: Observer):
        self._fn = fn

    def remove(self) -> None:
        if self._fn in _observers:
            _observers.remove(self._fn)

    def __enter__(self) -> ObserverHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def add_observer(fn: Observer) -> ObserverHandle:
    _observers.append(fn)
    return ObserverHandle(fn)


class Pending:
    """An in-flight collective; ``wait()`` blocks until it is complete."""

    __slots__ = ("_work", "event", "_done", "_blocked_since", "_rec")

    def __init__(self, work, event: CollectiveEvent | None, blocked_since: float | None = None,
                 rec=None):
        self._work = work
        self.event = event
        self._done = False
        self._blocked_since = blocked_since
        self._rec = rec  # the flight recorder's record (None inside a composite)

    def done(self) -> bool:
        """True once the collective has completed (never blocks)."""
        return self._done or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._done:
            return
        if self.event is None:
            t0 = 0.0
        else:
            t0 = self._blocked_since or time.perf_counter()
        if self._work is not None:
            gpu = self.event is not None and self.event.on_gpu
            if gpu:
                before = torch.cuda.Event(enable_timing=True)
                before.record()
            try:
                self._work.wait()
            except BaseException as exc:
                flight_recorder.failed(self._rec, exc)
                raise
            if gpu:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self.event.gpu_wait = (before, after)
        self._done = True
        flight_recorder.end(self._rec)
        if self.event is not None:
            now = time.perf_counter()
            self.event.end = now
            if self.event.finished is None:  # no future callback (yet): wait is the bound
                self.event.finished = now
            self.event.waited_s = now - t0
            for fn in list(_observers):
                fn("complete", self.event)


def _launch(op: str, tensor: torch.Tensor, tag: str, meta: dict | None) -> CollectiveEvent | None:
    if not _observers or getattr(_composite, "depth", 0):
        return None
    ev = CollectiveEvent(op, tensor.numel() * tensor.element_size(), tag, time.perf_counter(),
                         meta=meta or {}, on_gpu=tensor.is_cuda)
    for fn in list(_observers):
        fn("launch", ev)
    return ev


def _stamp_finished(ev: CollectiveEvent):
    def done(_fut) -> None:  # runs on the backend's thread: only set a float
        ev.finished = time.perf_counter()

    return done


def _record(op: str, tensor: torch.Tensor, group, tag: str):
    """Number the collective and keep it (fingerprint, flight recorder); not the
    steps inside a composite, which count as the composite."""
    if getattr(_composite, "depth", 0):
        return None
    return flight_recorder.begin(op, tensor, group, tag)


def _run(op: str, tensor: torch.Tensor, issue, async_op: bool, tag: str, meta: dict | None,
         group=None):
    rec = _record(op, tensor, group, tag)
    ev = _launch(op, tensor, tag, meta)
    if _nccl_watch is None:
        _start_watch()
    watched = rec is not None and flight_recorder.watching()
    try:
        # under the NCCL watchdog even a blocking call keeps its work: "blocking" only
        # makes the stream wait there, and the watchdog polls the work for completion
        work = issue(async_op or watched)
    except BaseException as exc:
        flight_recorder.failed(rec, exc)
        raise
    if watched:
        flight_recorder.track(rec, work)
    if not async_op:
        pending = Pending(work if watched else None, ev,
                          ev.start if ev is not None else None, rec)
        pending.wait()
        return pending
    if ev is not None and work is not None:
        try:
            work.get_future().then(_stamp_finished(ev))
        except (AttributeError, RuntimeError):  # a backend without futures: end = wait
            pass
    return Pending(work, ev, rec=rec)


_nccl_watch: bool | None = None  # decided at the first collective


def _start_watch() -> None:
    """On NCCL, the flight recorder's in-flight watchdog (``flight_recorder.watch``)."""
    global _nccl_watch
    if not dist.is_initialized():
        return
    _nccl_watch = dist.get_backend() == "nccl"
    if _nccl_watch:
        flight_recorder.watch(default_timeout_s())


def all_reduce(tensor, group=None, op=dist.ReduceOp.SUM, async_op=False, tag="", meta=None):
    return _run("all_reduce", tensor,
                lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a),
                async_op, tag, meta, group)


def broadcast(tensor, src_rank=0, group=None, async_op=False, tag="", meta=None):
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    return _run("broadcast", tensor,
                lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a),
                async_op, tag, meta, group)


# torch 2.13 renamed the single-tensor collectives; older releases in our range lack the new names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output, input, group=None, async_op=False, tag="", meta=None):
    """Gather every rank's ``input`` into the flat ``output`` (rank-major)."""
    return _run("all_gather", output,
                lambda a: _all_gather_single(output, input, group=group, async_op=a),
                async_op, tag, meta, group)


def reduce_scatter_single(output, input, group=None, op=dist.ReduceOp.SUM, async_op=False,
                          tag="", meta=None):
    """Sum ``input`` over ranks and leave rank r's equal slice of the result in ``output``."""
    return _run("reduce_scatter", input,
                lambda a: _reduce_scatter_single(output, input, op=op, group=group, async_op=a),
                async_op, tag, meta, group)


def barrier(group=None, tag: str = "") -> None:
    """Block the host until every rank of ``group`` has reached this point.

    The one way to order what ranks do on the host (files written before another
    rank reads them): a collective on a tensor is not one. On NCCL it returns to the
    host as soon as it is queued on the device, before the peers arrive (on gloo it
    blocks, which hid the difference). torch's barrier on NCCL waits for the device
    and the host both; it is told this rank's GPU, as torch asks.
    """
    kwargs = {}
    if dist.get_backend(group) == "nccl":
        kwargs["device_ids"] = [torch.cuda.current_device()]
    with composite("barrier", torch.empty(0, dtype=torch.uint8), tag, group=group):
        dist.barrier(group=group, **kwargs)


def all_gather_object(obj, group=None, tag: str = "") -> list:
    """Every rank's picklable ``obj``, by rank (blocking; off the hot path: checkpoints,
    error reports). Tensors in it are read to the host first (``host.to_host``): a
    device tensor pickled as it is would be unpickled by every rank onto the GPU it
    came from. Observed as one collective."""
    payload = host.to_host(obj)
    out = [None] * dist.get_world_size(group)
    with composite("all_gather_object", torch.empty(0, dtype=torch.uint8), tag, group=group):
        dist.all_gather_object(out, payload, group=group)
    return out


def gather_object(obj, dst: int = 0, group=None, tag: str = "") -> list | None:
    """Every rank's picklable ``obj`` on rank ``dst`` (by rank; None elsewhere), as
    :func:`all_gather_object` but to one rank only: payloads too large to hold on every
    rank (a trace's spans). Observed as one collective."""
    payload = host.to_host(obj)
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    with composite("gather_object", torch.empty(0, dtype=torch.uint8), tag, group=group):
        dist.gather_object(payload, out, dst=dst, group=group)
    return out


class _Exchange:
    """Point-to-point works that complete as one; ``finish`` runs once, after all of them."""

    __slots__ = ("_works", "_finish", "_tensors")

    def __init__(self, works, finish, tensors):
        self._works, self._finish, self._tensors = works, finish, tensors  # tensors: kept alive

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._tensors = None


def exchange(op: str, tensor: torch.Tensor, sends, recvs, group=None, p2p_tag: int = 0,
             finish=None, async_op=False, tag="", meta=None):
    """Post point-to-point sends and receives and treat them as one collective ``op``.

    ``sends`` / ``recvs``: ``[(tensor, group_rank), ...]``, posted as one
    ``batch_isend_irecv`` (NCCL's group call). Every rank must post the matching
    calls with the same ``p2p_tag`` (gloo matches by tag; NCCL ignores tags and
    matches the messages between a pair in the order posted). ``finish`` (no arguments) runs after
    all of them completed, inside ``wait()``, e.g. to sum received slices. Observers
    see one event named ``op`` sized by ``tensor``.
    """
    def peer(r):
        return r if group is None else dist.get_global_rank(group, r)

    def issue(_async):
        # One round is one batch_isend_irecv: NCCL runs a rank's messages in issue order
        # on one stream, so a pair that posts its receives before its sends in separate
        # calls waits for ever; one group call lets NCCL schedule them together
        # (nccl_rules.py refuses anything else). On gloo the batch is the same calls in
        # list order, receives first: over an emulated 100 Mbit/s link a 4 MB two-way
        # exchange took 354-381 ms so against 609-705 ms with the sends posted first
        # (docs/netlab.md); no consistent difference over loopback.
        ops = [dist.P2POp(dist.irecv, t, peer(r), group=group, tag=p2p_tag) for t, r in recvs]
        ops += [dist.P2POp(dist.isend, t, peer(r), group=group, tag=p2p_tag) for t, r in sends]
        works = dist.batch_isend_irecv(ops) if ops else []
        work = _Exchange(works, finish, (sends, recvs))
        if not _async:
            work.wait()
        return work

    return _run(op, tensor, issue, async_op, tag, meta, group)


_composite = threading.local()  # depth of composite() on this thread


@contextlib.contextmanager
def composite(op: str, tensor: torch.Tensor, tag: str = "", meta: dict | None = None,
              group=None):
    """One observed collective ``op`` built of many point-to-point steps.

    The reference algorithms (engine/algorithms/) move a tensor in rounds of
    ``exchange`` calls; observers see one event for the whole operation, launched
    on entry and complete on a normal exit, and not the steps issued inside on
    this thread (so a bucket's all-reduce counts once whatever algorithm moves it).
    Nested uses report only the outermost. Blocking: the event's wait is its whole
    duration.
    """
    depth = getattr(_composite, "depth", 0)
    rec = _record(op, tensor, group, tag)
    ev = _launch(op, tensor, tag, meta) if depth == 0 else None
    _composite.depth = depth + 1
    try:
        yield
    except BaseException as exc:
        flight_recorder.failed(rec, exc)
        raise
    finally:
        _composite.depth = depth
    Pending(None, ev, ev.start if ev is not None else None, rec).wait()
