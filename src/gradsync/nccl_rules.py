"""NCCL's rules, enforced on gloo: a process group that refuses what NCCL would.

gradsync runs on NCCL wherever users have GPUs, and on gloo everywhere else, this
project's CI included. Code that is correct on gloo can hang or fail on NCCL,
because NCCL is stricter in ways gloo never shows:

* **device**: a NCCL group moves tensors of its GPU only; a CPU tensor handed to it
  is an error ("No backend type associated with device type cpu", seen on an H100
  with torch 2.11), and so is any tensor whose device is not the group's;
* **point-to-point rounds**: NCCL runs a rank's sends and receives in issue order on
  one stream, and a receive blocks that stream until its peer's send arrives. Two
  ranks that each post a receive before their send wait for each other for ever.
  A round in which a rank has more than one message in flight must therefore be one
  ``torch.distributed.batch_isend_irecv`` (one NCCL group call). NCCL also ignores
  the ``tag`` of a message: messages between a pair match in the order posted;
* **threads**: collectives on one communicator must be issued in the same order on
  every rank; two threads issuing on one group order them by timing, which differs
  between ranks (a mismatch, or a hang);
* **contiguity**: NCCL reads and writes flat memory: a non-contiguous tensor is refused.

:class:`StrictGroup` is a ``torch.distributed`` process group that wraps
``ProcessGroupGloo`` and raises :class:`NcclRuleError` (one line: the rule, the
operation, the tensor, the fix) on each of these, before gloo sees the call. It
moves real values, so the multi-rank exactness tests run under it unchanged
(``GRADSYNC_NCCL_RULES=1``; :func:`gradsync.dist.init` and :func:`gradsync.spawn`
then initialise it in place of gloo, and CI runs the core multi-rank tests so).

``GRADSYNC_NCCL_RULES=meta`` names an emulated accelerator instead: the group's
device is ``meta``, so models and every buffer the engine allocates on the
communication device live on ``meta`` (shapes, no values: backward runs, values do
not exist). torch's collectives on ``meta`` tensors never reach a backend (they are
shape-only no-ops), so every tensor that does reach this group is a host tensor
handed to an accelerator's group: refused, as NCCL refuses it. This is how a CPU
machine sees a buffer the engine forgot to place on the device.

What it cannot see (``docs/gpu.md``): streams and their ordering, a collective used
as a host barrier (NCCL returns to the host before the peers arrive; gloo does
not), memory, and NCCL's own limits.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
import zlib
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .errors import UsageError

BACKEND = "gradsync_nccl_rules"
ENV = "GRADSYNC_NCCL_RULES"
MODES = ("0", "1", "meta")


class NcclRuleError(RuntimeError):
    """A call NCCL would refuse or deadlock on (raised by :class:`StrictGroup`)."""


def mode() -> str:
    """``""`` (off), ``"cpu"`` (NCCL's rules on real CPU tensors) or ``"meta"``."""
    raw = os.environ.get(ENV, "0").strip().lower()
    if raw not in MODES and raw not in ("cpu", "true", "yes"):
        raise UsageError(f"{ENV} must be 0, 1 or meta, got {raw!r}")
    if raw in ("0", ""):
        return ""
    return "meta" if raw == "meta" else "cpu"


def enabled() -> bool:
    return bool(mode())


class _Work(dist.Work):
    """A gloo work whose ``wait`` the group sees (point-to-point bookkeeping)."""

    def __init__(self, inner, on_done=None):
        super().__init__()
        self._inner = inner
        self._on_done = on_done

    def _done(self) -> None:
        if self._on_done is not None:
            self._on_done(self)
            self._on_done = None

    def wait(self, timeout=None):
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._done()
        return ok

    def is_completed(self) -> bool:
        done = self._inner.is_completed()
        if done:
            self._done()
        return done

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def get_future(self):
        return self._inner.get_future()

    def result(self):
        return self._inner.result()


class _Done(dist.Work):
    """A completed work (shape-only collectives of the emulated accelerator)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([])
        return fut


def _batch_frame():
    """The frame of the ``torch.distributed.batch_isend_irecv`` call on the stack, if any:
    one such call is one NCCL group call (``ncclGroupStart``/``End``)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "batch_isend_irecv" and "distributed" in code.co_filename:
            return frame
        frame = frame.f_back
    return None


_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                       "scatter_object_list")


class StrictGroup(dist.ProcessGroup):
    """gloo with NCCL's refusals (module docstring). One per ``torch.distributed`` group."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, device: str):
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        self.device_type = device
        self._owner: threading.Thread | None = None
        self._open_p2p: weakref.WeakSet = weakref.WeakSet()  # messages not yet waited for
        self._batch = None  # the batch_isend_irecv frame of the messages in flight
        self._inflight: weakref.WeakSet = weakref.WeakSet()  # every work, for handoffs
        self._name, self._desc = "", ""
        self._lock = threading.Lock()
        self.ops: list[str] = []  # every operation issued, in order (tests read it)

    # torch's names (the C++ virtuals a Python process group overrides)
    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _shape_only(self, op: str, tensors):
        """A collective of the emulated accelerator: no values move (``meta`` has
        none); every rank's (operation, dtype, element count) is compared through gloo
        instead, so calls that NCCL would pair wrongly are an error here."""
        desc = torch.tensor([zlib.crc32(op.encode()),
                             zlib.crc32(",".join(str(t.dtype) for t in tensors).encode()),
                             sum(t.numel() for t in tensors), len(tensors)], dtype=torch.int64)
        everyone = torch.empty(self.size() * 4, dtype=torch.int64)
        self._gloo._allgather_base(everyone, desc, c10d.AllgatherOptions()).wait()
        rows = everyone.view(-1, 4)
        if not bool((rows == desc).all()):
            raise NcclRuleError(
                f"{op} #{len(self.ops)} ({sum(t.numel() for t in tensors)} elements, "
                f"{tensors[0].dtype if tensors else '-'}): the ranks issued different "
                f"collectives here (element counts per rank: {rows[:, 2].tolist()})")
        return _Done()

    def _run(self, op, tensors, call):
        if self._issue(op, tensors):
            return self._shape_only(op, tensors)
        return self._watch(call())

    def _watch(self, work):
        """Keep ``work`` in the in-flight set (the thread rule's handoff test)."""
        wrapped = work if isinstance(work, _Work) else _Work(work)
        self._inflight.add(wrapped)
        return wrapped

    # ------------------------------------------------------------------ the rules
    def _issue(self, op: str, tensors) -> bool:
        """Check the rules for one call; True when it is to run shape-only (meta)."""
        me = threading.current_thread()
        with self._lock:
            owner = self._owner
            if owner is not None and owner is not me and owner.is_alive():
                busy = [w for w in list(self._inflight) if not w._inner.is_completed()]
                if busy:
                    raise NcclRuleError(
                        f"{op}: thread {me.name!r} issues a collective on a group while "
                        f"thread {owner.name!r} has {len(busy)} in flight on it; NCCL needs "
                        "one issuing order per group on every rank, and two threads order "
                        "their calls by timing: give each thread its own process group")
            self._owner = me
            self.ops.append(op)
        if _called_from_any(_OBJECT_COLLECTIVES):
            self._check_object_payload(op, tensors)
            return False
        for t in tensors:
            self._check_tensor(op, t)
        return self.device_type == "meta"

    def _check_object_payload(self, op: str, tensors) -> None:
        """Object collectives pickle on the host and move bytes (on NCCL, through the
        GPU). A tensor of the accelerator inside the object is pickled with its device
        and every rank unpickles it onto the sender's GPU: refused."""
        for t in tensors:
            if t.dtype == torch.uint8 and t.device.type == "cpu" and t.numel():
                data = t.numpy().tobytes()
                if b"_rebuild_meta_tensor" in data or b"cuda" in data:
                    raise NcclRuleError(
                        f"{op}: an object collective carries tensors of the accelerator; "
                        "each rank would unpickle them onto the sender's device: move them "
                        "to the CPU first, or gather them with a tensor collective")

    def _check_tensor(self, op: str, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            raise NcclRuleError(
                f"{op}: a {t.device.type} tensor (shape {list(t.shape)}, "
                f"{str(t.dtype).replace('torch.', '')}) handed to a group whose device is "
                f"{self.device_type}; NCCL moves tensors of its GPU only: allocate it on "
                "the communication device (gradsync.dist.comm_device())")
        if not t.is_contiguous():
            raise NcclRuleError(
                f"{op}: a non-contiguous tensor (shape {list(t.shape)}, strides "
                f"{list(t.stride())}); NCCL needs contiguous memory")

    def _p2p(self, op: str, tensors, peer: int) -> bool:
        """A message may join the round in flight only if both are one
        ``batch_isend_irecv`` call; otherwise every earlier message must have been
        waited for. (Two batches in a row, receives then sends, deadlock on NCCL just as
        two ungrouped calls do: the second queues behind the first on the stream.)"""
        meta = self._issue(op, tensors)
        batch = _batch_frame()
        if batch is not None and batch is self._batch:
            return meta
        open_now = list(self._open_p2p)
        if open_now:
            raise NcclRuleError(
                f"{op} with rank {peer} while {len(open_now)} earlier point-to-point "
                "message(s) of this rank are in flight, not in the same group call: NCCL "
                "runs them in issue order on one stream, and two ranks that both receive "
                "first wait for each other for ever; post the whole round as one "
                "torch.distributed.batch_isend_irecv")
        self._batch = batch  # kept alive, so a later call's frame cannot share its id
        return meta

    def _track(self, work) -> _Work:
        wrapped = _Work(work, self._open_p2p.discard)
        self._open_p2p.add(wrapped)
        return self._watch(wrapped)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        return self._run("all_reduce", tensors, lambda: self._gloo.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        return self._run("all_reduce_coalesced", tensors,
                         lambda: self._gloo.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        return self._run("broadcast", tensors, lambda: self._gloo.broadcast(tensors, opts))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        return self._run("all_gather", [*inputs, *(t for lst in output_lists for t in lst)],
                         lambda: self._gloo.allgather(output_lists, inputs, opts))

    def all_gather_single(self, output, input, opts=None):
        opts = opts or c10d.AllgatherOptions()
        return self._run("all_gather_single", [output, input],
                         lambda: self._gloo._allgather_base(output, input, opts))

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._run("reduce_scatter", [*outputs, *(t for lst in input_lists for t in lst)],
                         lambda: self._gloo.reduce_scatter(outputs, input_lists, opts))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._run("reduce_scatter_single", [output, input],
                         lambda: self._gloo._reduce_scatter_base(output, input, opts))

    _reduce_scatter_base = reduce_scatter_single

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        return self._run("gather", [*inputs, *(t for lst in output_lists for t in lst)],
                         lambda: self._gloo.gather(output_lists, inputs, opts))

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ScatterOptions()
        return self._run("scatter", [*outputs, *(t for lst in input_lists for t in lst)],
                         lambda: self._gloo.scatter(outputs, input_lists, opts))

    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        return self._run("reduce", tensors, lambda: self._gloo.reduce(tensors, opts))

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        opts = opts or c10d.AllToAllOptions()
        return self._run("all_to_all", [output, input], lambda: self._gloo.alltoall_base(
            output, input, output_splits, input_splits, opts))

    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        # NCCL's barrier blocks the host until every rank arrived (torch waits on it),
        # as gloo's does: the one collective that may order host actions
        with self._lock:
            self.ops.append("barrier")
        return self._gloo.barrier(opts or c10d.BarrierOptions())

    # ------------------------------------------------------------------ point-to-point
    def send(self, tensors, dst: int, tag: int = 0):
        meta = self._p2p("send", tensors, dst)
        payload = [self._p2p_desc(tensors)] if meta else tensors
        return self._track(self._gloo.send(payload, dst, 0))  # NCCL ignores tags

    def recv(self, tensors, src: int, tag: int = 0):
        meta = self._p2p("recv", tensors, src)
        payload = [torch.empty(2, dtype=torch.int64)] if meta else tensors
        return self._track(self._gloo.recv(payload, src, 0))

    @staticmethod
    def _p2p_desc(tensors) -> torch.Tensor:
        return torch.tensor([sum(t.numel() for t in tensors), len(tensors)], dtype=torch.int64)

    def recv_anysource(self, tensors, tag: int = 0):
        raise NcclRuleError("recv from any source: NCCL has no wildcard receive")

    # ------------------------------------------------------------------ housekeeping
    def abort(self):
        self._gloo.abort()

    def shutdown(self):
        self._gloo.shutdown()

    def set_timeout(self, timeout):
        self._gloo.set_timeout(timeout)


def _called_from_any(names) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in names and "distributed" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _create(store, rank, size, timeout):
    return StrictGroup(store, rank, size, timeout, "meta" if mode() == "meta" else "cpu")


def register() -> str:
    """Make the backend known to ``torch.distributed`` (idempotent); returns its name."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    return BACKEND


def group_device(group=None) -> torch.device:
    """The device of a strict group: ``cpu``, or ``meta`` for the emulated accelerator."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return torch.device(getattr(pg, "device_type", "cpu"))
