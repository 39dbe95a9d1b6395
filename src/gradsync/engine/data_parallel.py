"""DataParallel: replicas that stay identical and a gradient that is exactly the global mean.

How a synchronised backward runs (DDP paper, arXiv 2006.15704, section 3.2):

1. Gradients accumulate into flat bucket buffers (``param.grad`` is a view).
2. A post-accumulate-grad hook marks each parameter ready; when a bucket's last
   gradient lands, that bucket's all-reduce is launched asynchronously, so
   communication overlaps the rest of backward. Buckets launch strictly in index
   order on every rank, which keeps collectives matched across ranks whatever
   order gradients arrive in.
3. A callback queued on the autograd engine runs once backward is over: it
   launches anything not yet launched (unused parameters), waits for every
   bucket and divides. When ``backward()`` returns, gradients are synchronised.

Exactness (seed 003, "sum or mean"): ``backward(loss, num_items=n)`` turns this
micro-batch's mean loss into a sum by scaling with ``n``; the window's item count
travels in a 24-byte header all-reduce launched as backward starts (so it hides
behind compute), and the summed gradient is divided by the *global* item count.
That is the gradient of the mean loss over every item of the global batch, across
ranks and ``no_sync`` micro-steps, whatever each one held. Plain
``loss.backward()`` keeps DDP's convention (divide by world size: an average of
per-rank means), exact only when every rank holds the same number of items.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnusedParametersError, UsageError
from . import comm, tracing
from .autotune import AutotuneResult, BucketAutotuner
from .bucketing import BucketSpec, ParamSpec, mb_to_bytes, plan_buckets
from .buckets import Bucket
from .item_window import HEADER_SLOTS, ItemWindow
from .replicas import broadcast_module_state, broadcast_tensors, comm_device, verify_same_structure


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o)


def _as_count(num_items) -> float:
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise UsageError(
                f"num_items must be a scalar, got a tensor of shape {tuple(num_items.shape)}")
        num_items = num_items.item()
    try:
        n = float(num_items)
    except (TypeError, ValueError):
        raise UsageError(f"num_items must be a number, got {num_items!r}") from None
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise UsageError(f"num_items counts items: a whole number >= 0, got {num_items!r}")
    return n


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``group`` (default: the world).

    Args:
        module: the model; identical structure on every rank (checked), rank 0's
            values are broadcast to all ranks at construction.
        group: process group; ``None`` means the default (world) group.
        bucket_cap_mb: cap of a gradient bucket in MiB (DDP's default, 25), or
            ``"auto"``: measure candidate caps during the first synchronised steps
            and keep the fastest (see ``engine/autotune.py``; ``autotune_result``).
        first_bucket_mb: cap of the first bucket, small so communication starts early.
        find_unused_parameters: ``False``: a parameter with no gradient in a
            synchronised backward is an error naming it. ``True``: it counts as a
            zero gradient and the step completes on every rank.
        broadcast_buffers: broadcast rank 0's buffers before every training forward
            (as DDP does), e.g. BatchNorm running statistics.

    ``state_dict()``/``load_state_dict()`` are the unwrapped module's: checkpoints
    carry no ``module.`` prefix.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float | str = 25,
                 first_bucket_mb: float = 1, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("DataParallel needs an initialised process group: call "
                             "gradsync.init() (torchrun) or run inside gradsync.spawn()")
        if not isinstance(module, nn.Module):
            raise UsageError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._autotuner: BucketAutotuner | None = None
        if isinstance(bucket_cap_mb, str):
            if bucket_cap_mb != "auto":
                raise UsageError("bucket_cap_mb must be a size in MiB or 'auto', "
                                 f"got {bucket_cap_mb!r}")
        elif not bucket_cap_mb > 0:
            raise UsageError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if not first_bucket_mb > 0:
            raise UsageError(f"first_bucket_mb must be > 0, got {first_bucket_mb!r}")
        self.first_bucket_bytes = mb_to_bytes(first_bucket_mb)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._comm_device = comm_device(group)

        verify_same_structure(module, group, what="DataParallel")
        broadcast_module_state(module, group)

        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._params: list[nn.Parameter] = []
        self._names: list[str] = []
        for p in module.parameters():
            if p.requires_grad:
                self._params.append(p)
                self._names.append(" = ".join(aliases[id(p)]))
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise UsageError("DataParallel expects a module on one device, found "
                             f"{sorted(map(str, devices))}")
        self._specs = [ParamSpec(n, p.numel(), p.element_size(), str(p.dtype).replace("torch.", ""))
                       for n, p in zip(self._names, self._params)]
        if bucket_cap_mb == "auto":
            self._autotuner = BucketAutotuner(sum(s.nbytes for s in self._specs))
            bucket_cap_mb = self._autotuner.current_mb
        self.bucket_cap_bytes = mb_to_bytes(bucket_cap_mb)
        self._buffers_to_sync = [b for b in module.buffers() if b.numel()]

        self._require_sync = True
        self._forward_sync: bool | None = None
        self._in_backward = False
        self._syncing = False
        self._window = ItemWindow(self.world_size, self.rank)
        self._ready: list[bool] = [False] * len(self._params)
        self._next_bucket = 0
        self._meta: comm.Pending | None = None
        self._meta_tensor = torch.zeros(HEADER_SLOTS, dtype=torch.float64,
                                        device=self._comm_device)
        self._order_log: list[int] | None = None
        self._ready_order: list[int] | None = None
        self._rebuilt = False
        self._pass_t0 = 0.0
        self._hooks: list = []
        self._reduction = None  # None: all-reduce every bucket (see set_reduction)
        self._trace_t0: float | None = None

        self._install_buckets(
            plan_buckets(self._specs, self.bucket_cap_bytes, self.first_bucket_bytes))
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    # ------------------------------------------------------------------ layout
    def _install_buckets(self, specs: list[BucketSpec]) -> None:
        # The window's item count rides at the end of the first bucket's buffer when
        # its dtype carries whole numbers exactly (see ItemWindow.write); ZeRO strategies
        # shard bucket buffers, so they keep the separate header collective.
        self._piggyback = (self._reduction is None and bool(specs)
                           and specs[0].dtype in ("float32", "float64"))
        size = (lambda s: self._reduction.bucket_numel(s)) if self._reduction else (lambda s: None)
        self._buckets = [Bucket(s, [self._params[i] for i in s.params], size(s)) for s in specs]
        if self._piggyback:
            first = specs[0]
            self._buckets[0] = Bucket(first, [self._params[i] for i in first.params],
                                      first.numel + HEADER_SLOTS)
        self._where: list[tuple[Bucket, int]] = [None] * len(self._params)  # type: ignore[list-item]
        for b in self._buckets:
            for slot, i in enumerate(b.spec.params):
                self._where[i] = (b, slot)
            b.attach(keep_values=True)

    def set_reduction(self, reduction) -> None:
        """Hand bucket communication to ``reduction`` (the ZeRO extension point).

        ``reduction`` decides how a ready bucket travels and how a synchronised
        backward ends; the hooks, launch order, header and ``num_items`` accounting
        stay here, so every strategy keeps DataParallel's exact semantics. It
        provides ``bucket_numel(spec)`` (buffer length, e.g. padded to a multiple of
        the world size), ``prepare()`` (called before gradients accumulate),
        ``ensure(bucket)`` (before a gradient is copied into a bucket: a strategy
        may release bucket storage, ZeRO-2 does, and re-allocate it here on first
        use), ``launch(bucket) -> comm.Pending`` and ``finish(divisor)`` (after
        every launched bucket completed). The bucket
        layout is frozen from here on (no rebuild), because sharded optimizer state
        lives in it.
        """
        if self._in_backward:
            raise UsageError("set_reduction() called during backward")
        if self._reduction is not None:
            raise UsageError("this DataParallel already has a reduction strategy "
                             "(is it wrapped by two ZeroOptimizers?)")
        if self._autotuner is not None and not self._autotuner.done:
            raise UsageError("sharded optimizer state needs a fixed bucket layout: give "
                             "DataParallel a number for bucket_cap_mb, not 'auto'")
        self._reduction = reduction
        self._rebuilt = True
        self._order_log = None
        self._install_buckets([b.spec for b in self._buckets])

    @property
    def buckets(self) -> list[Bucket]:
        return self._buckets

    @property
    def trainable_names(self) -> list[str]:
        return list(self._names)

    @property
    def bucket_plan(self) -> list[BucketSpec]:
        """The bucket assignment in use (launch order), as the planner sees it."""
        return [b.spec for b in self._buckets]

    @property
    def param_specs(self) -> list[ParamSpec]:
        """Trainable parameters in registration order (tied weights once)."""
        return list(self._specs)

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        tracer = tracing.ACTIVE
        t0 = tracing.now() if tracer is not None else 0.0
        grad_on = torch.is_grad_enabled()
        if grad_on:
            if not self._in_backward:
                self._forward_sync = self._require_sync
            if self.broadcast_buffers and self._buffers_to_sync and self.training:
                broadcast_tensors(self._buffers_to_sync, self.group, tag="buffers")
            if self._reduction is not None:
                self._reduction.prepare()
            # No re-attaching of bucket views here: after zero_grad(set_to_none=True)
            # autograd hands over a fresh gradient and the hook copies it into the
            # bucket once (as DDP does); re-attaching zeroed views would cost a fill
            # plus an accumulate, twice the memory traffic. With zero_grad() that
            # keeps the views, gradients accumulate straight into the bucket.
        out = self.module(*args, **kwargs)
        if grad_on:
            for t in _tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self._output_grad_hook)
        if tracer is not None:
            tracer.record("forward", "compute", t0, tracing.now(), sync=self._require_sync)
        return out

    def _output_grad_hook(self, grad):
        self._start_pass()
        return None

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor | None = None, num_items=None,
                 **backward_kwargs) -> None:
        """Backward with the exact global mean when ``num_items`` is given.

        ``loss`` is the mean over this micro-batch's ``num_items`` items (samples or
        tokens). With ``num_items=0`` the loss is ignored (it may be ``None`` or NaN,
        as a mean over nothing is) and this rank joins the synchronisation with a
        zero contribution, so ranks with uneven data never leave others waiting.
        """
        if num_items is None:
            if loss is None:
                raise UsageError(
                    "backward() needs a loss (or num_items=0 for an empty micro-batch)")
            loss.backward(**backward_kwargs)
            return
        n = _as_count(num_items)
        if self._in_backward:
            raise UsageError("backward() called while another backward through this model "
                             "is running")
        if n and loss is None:
            raise UsageError(f"backward() got num_items={num_items} but no loss")
        with self._window.item_pass(n):
            if n == 0:
                torch.autograd.backward(self._params, [torch.zeros_like(p) for p in self._params])
            else:
                (loss * n).backward(**backward_kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally with no communication at all.

        The decision is taken at forward time (as in DDP): run the micro-step's
        forward and backward inside the context; the next synchronised backward
        reduces everything accumulated since the last sync, once.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def _start_pass(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        if self._reduction is not None:
            self._reduction.prepare()
        self._trace_t0 = tracing.now() if tracing.ACTIVE is not None else None
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._window.pass_started()
        sync = self._forward_sync if self._forward_sync is not None else self._require_sync
        self._syncing = sync
        if not sync:
            return
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._pass_t0 = time.perf_counter()
        if not self._piggyback:
            self._window.write(self._meta_tensor)
            self._meta = comm.all_reduce(self._meta_tensor, self.group, async_op=True,
                                         tag="header")
        if not self._rebuilt:
            self._order_log = []

    def _make_hook(self, i: int):
        def hook(param):
            if not self._in_backward:
                self._start_pass()
            bucket, slot = self._where[i]
            if not bucket.is_view(slot):
                if self._reduction is not None:
                    self._reduction.ensure(bucket)
                bucket.adopt(slot)
            if not self._syncing:
                return
            if self._ready[i]:
                raise UsageError(f"parameter {self._names[i]!r} received its gradient twice in one "
                                 "backward; reentrant activation checkpointing is not supported, "
                                 "use torch.utils.checkpoint(..., use_reentrant=False)")
            self._ready[i] = True
            if self._order_log is not None:
                self._order_log.append(i)
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready_buckets()
        return hook

    def _launch_ready_buckets(self) -> None:
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            b = buckets[self._next_bucket]
            if self._piggyback and self._next_bucket == 0:
                self._window.write(b.buffer[-HEADER_SLOTS:])
            if self._reduction is not None:
                b.handle = self._reduction.launch(b)
            else:
                b.handle = comm.all_reduce(b.buffer, self.group, async_op=True,
                                           tag=f"bucket{b.spec.index}",
                                           meta={"bucket": b.spec.index, "params": len(b.params)})
            b.launched = True
            self._next_bucket += 1

    def _end_of_backward(self) -> None:
        sync = self._syncing
        try:
            if self._syncing:
                self._finish_sync()
        finally:
            self._in_backward = False
            self._syncing = False
            self._forward_sync = None
            self._window.pass_ended()
            for b in self._buckets:
                b.reset()
            if self._trace_t0 is not None and tracing.ACTIVE is not None:
                tracing.ACTIVE.record("backward", "compute", self._trace_t0, tracing.now(),
                                      sync=sync)
            self._trace_t0 = None

    def _finish_sync(self) -> None:
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        for i in missing:  # zero contribution; launch so no peer waits on us
            bucket, slot = self._where[i]
            if not bucket.is_view(slot):
                if self._reduction is not None:
                    self._reduction.ensure(bucket)
                bucket.adopt(slot)
            bucket.pending -= 1
        self._launch_ready_buckets()
        t_wait = tracing.now() if tracing.ACTIVE is not None else None
        if self._meta is not None:
            self._meta.wait()
        for b in self._buckets:
            b.handle.wait()
        summed = self._buckets[0].buffer[-HEADER_SLOTS:] if self._piggyback else self._meta_tensor
        if t_wait is not None and tracing.ACTIVE is not None:  # end of backward blocked on comm
            tracing.ACTIVE.record("sync wait", "wait", t_wait, tracing.now(),
                                  buckets=len(self._buckets))
        self._meta = None
        if missing and not self.find_unused_parameters:
            self._order_log = None
            self._window.reset()
            names = ", ".join(repr(self._names[i]) for i in missing)
            raise UnusedParametersError(
                f"rank {self.rank}: {len(missing)} parameter(s) received no gradient in this "
                f"synchronised backward: {names}. Make every parameter take part in the loss, "
                "freeze them (requires_grad=False), or pass find_unused_parameters=True to "
                "treat them as zero gradients")
        divisor = self._window.close(summed)
        if self._reduction is not None:
            self._reduction.finish(divisor)
        else:
            for b in self._buckets:
                b.buffer.div_(divisor)
        if self._order_log is not None:
            seen = set(self._order_log)
            order = self._order_log + [i for i in range(len(self._params)) if i not in seen]
            self._order_log = None
            self._rebuild(order)
        elif self._autotuner is not None and not self._autotuner.done:
            self._autotune_step(time.perf_counter() - self._pass_t0)

    def _rebuild(self, local_order: list[int]) -> None:
        """Rebuild buckets once, in the order gradients became ready on rank 0.

        Rank 0's order is broadcast so every rank builds the same buckets (ranks
        must launch identical collectives in identical order).
        """
        order = torch.tensor(local_order, dtype=torch.int64, device=self._comm_device)
        comm.broadcast(order, 0, self.group, tag="rebuild")
        self._rebuilt = True
        self._ready_order = order.tolist()
        self._replan()

    def _replan(self) -> None:
        specs = plan_buckets(self._specs, self.bucket_cap_bytes, self.first_bucket_bytes,
                             order=self._ready_order)
        if [s.params for s in specs] != [b.spec.params for b in self._buckets]:
            self._install_buckets(specs)

    def _autotune_step(self, seconds: float) -> None:
        tuner = self._autotuner
        action = tuner.record(seconds)
        if action == "stay":
            return
        if action == "decide":  # every rank adopts the choice that suits the slowest rank
            medians = torch.tensor(tuner.result.median_s, dtype=torch.float64,
                                   device=self._comm_device)
            comm.all_reduce(medians, self.group, op=dist.ReduceOp.MAX, tag="autotune")
            tuner.decide(medians.tolist())
        self.bucket_cap_bytes = mb_to_bytes(tuner.current_mb)
        self._replan()

    @property
    def autotune_result(self) -> AutotuneResult | None:
        """Candidates, the slowest rank's median per candidate and the choice (``"auto"`` only)."""
        return None if self._autotuner is None else self._autotuner.result

    # ------------------------------------------------------------------ housekeeping
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the bucket buffers in place (gradients stay views into them)."""
        if self._reduction is not None:
            self._reduction.prepare()
        for b in self._buckets:
            if not b.buffer.untyped_storage().nbytes():  # released by a sharded reduction
                continue
            b.buffer.zero_()
            if not set_to_none:
                b.attach(keep_values=True)
        if set_to_none:
            for p in self._params:
                p.grad = None

    def unwrap(self) -> nn.Module:
        """Remove every hook and give gradients their own storage; returns the module."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for b in self._buckets:
            b.detach_grads()
        return self.module

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, buckets={len(self._buckets)}, "
                f"bucket_cap_mb={self.bucket_cap_bytes / 2**20:g}, "
                f"find_unused_parameters={self.find_unused_parameters}")
