"""DataParallel: replicas that stay identical and a gradient that is exactly the global mean.

How a synchronised backward runs (DDP paper, arXiv 2006.15704, section 3.2):
gradients accumulate into flat bucket buffers (``param.grad`` is a view); a
post-accumulate-grad hook marks each parameter ready, and a bucket whose last
gradient landed is launched asynchronously (a ``buckets.reduction.BucketReduction``
decides how it travels: all-reduce by default), strictly in index order on every
rank, so communication overlaps the rest of backward and collectives stay
matched whatever order gradients arrive in. At the end of backward everything
left is launched, waited for and divided by the global item count (the header
rides in the first bucket when buckets are summed exactly). Passes, windows,
``num_items``, ``no_sync``, buffers and the DDP-compatibility rules are the
synchronised-backward core's (``sync/core.py``); the bucket layout, its rebuild
and autotuning are ``buckets/layout.py``'s; what happens as each gradient arrives
is ``gradient_arrivals.py``'s.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ...errors import UsageError
from ..buckets.algorithm_reduction import AlgorithmBuckets
from ..buckets.autotune import BucketAutotuner
from ..buckets.layout import BucketAccess, BucketLayout, trainable_parameters
from ..buckets.plan import BucketSpec, mb_to_bytes
from ..buckets.reduction import AllReduceBuckets, BucketReduction
from ..sync.accumulators import hook_accumulators
from ..sync.arrivals import Arrivals
from ..sync.core import SyncedModule
from ..sync.protocol import Collected
from ..sync.replicas import (
    broadcast_module_state,
    comm_device,
    verify_same_setup,
    verify_same_structure,
)
from ..transport import tracing
from .ddp_compat import DDPMethods, accept_module_keys, resolve_ddp_keywords
from .gradient_arrivals import GradientArrivals


class DataParallel(GradientArrivals, DDPMethods, BucketAccess, SyncedModule):
    """Wrap ``module`` for data-parallel training over ``group`` (default: the world).

    Args:
        module: the model; identical structure on every rank (checked), rank 0's
            values are broadcast to all ranks at construction.
        group: process group; ``None`` means the default (world) group.
        bucket_cap_mb: cap of a gradient bucket in MiB (DDP's default, 25), or
            ``"auto"``: measure candidate caps during the first synchronised steps
            and keep the fastest (see ``buckets/autotune.py``; ``autotune_result``).
        first_bucket_mb: cap of the first bucket, small so communication starts early.
        find_unused_parameters: ``False``: a parameter with no gradient in a
            synchronised backward is an error naming it. ``True``: a used mask is
            summed with the gradients; a parameter some rank used counts as zero on
            the others, one no rank used keeps its ``.grad`` (None) as in torch DDP.
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm running
            statistics) exactly when torch DDP does: before the first forward and
            before any forward that follows a synchronised grad-enabled forward,
            training or evaluating.
        collectives: ``"native"`` (the backend's all-reduce), or a reference algorithm
            on a communication thread: ``"hierarchical"`` (two-level, for hosts joined
            by a slow link; ``topology`` or torchrun's layout), ``"ring"``, ``"tree"``,
            ``"server"`` (``buckets/algorithm_reduction.py``).
        topology: a :class:`~gradsync.engine.transport.algorithms.HostTopology` for
            ``"hierarchical"`` (e.g. ``HostTopology(ranks_per_host=2)``).
        reduction: how buckets travel, overriding ``collectives`` (e.g. compression).
        **ddp_keywords: torch DDP's own (``process_group``, ``device_ids``, ...), accepted
            where they mean something here (``ddp_compat.py``).

    ``state_dict()``/``load_state_dict()`` are the unwrapped module's: checkpoints
    carry no ``module.`` prefix.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float | str = 25,
                 first_bucket_mb: float = 1, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, collectives: str = "native",
                 topology=None, reduction: BucketReduction | None = None, *,
                 _in_sync: bool = False, **ddp_keywords):
        group = resolve_ddp_keywords(module, group, ddp_keywords)
        super().__init__(module, group, find_unused_parameters, broadcast_buffers,
                         "DataParallel")
        if isinstance(bucket_cap_mb, str):
            if bucket_cap_mb != "auto":
                raise UsageError("bucket_cap_mb must be a size in MiB or 'auto', "
                                 f"got {bucket_cap_mb!r}")
        elif not bucket_cap_mb > 0:
            raise UsageError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if not first_bucket_mb > 0:
            raise UsageError(f"first_bucket_mb must be > 0, got {first_bucket_mb!r}")
        self._comm_device = comm_device(group)
        settings = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                        find_unused_parameters=find_unused_parameters,
                        broadcast_buffers=broadcast_buffers)
        if not _in_sync:  # a deepcopy of a replica is in sync already: no collectives
            verify_same_structure(module, group, what="DataParallel")
            verify_same_setup({**settings, "collectives": collectives,
                               "static_graph": ddp_keywords.get("static_graph", False)},
                              group, what="DataParallel")
            broadcast_module_state(module, group)
        self._init_kwargs = dict(ddp_keywords, group=group, **settings)  # to wrap copies

        self._params, self._names, self._specs = trainable_parameters(module)
        tuner = None
        if bucket_cap_mb == "auto":
            tuner = BucketAutotuner(sum(s.nbytes for s in self._specs))
            bucket_cap_mb = tuner.current_mb
        self._layout = BucketLayout(self._params, self._specs, mb_to_bytes(bucket_cap_mb),
                                    mb_to_bytes(first_bucket_mb), group, self._comm_device, tuner)
        self.collectives = collectives
        self._custom_reduction = reduction is not None  # ZeRO may replace a collectives choice
        if reduction is None and collectives != "native":
            reduction = AlgorithmBuckets(collectives, topology)
        self._reduction: BucketReduction = reduction or AllReduceBuckets()
        self._reduction.attach(self)
        self.topology = getattr(self._reduction, "topology", None) or topology
        self._arrivals = Arrivals(self._names, ddp_keywords.get("static_graph", False))
        self._used = [False] * len(self._params)  # over the open window, this rank
        self._written = [False] * len(self._params)  # a gradient accumulated in the window
        # gradients autograd wrote outside their bucket and the hook then copied in (a
        # fresh .grad after zero_grad(set_to_none=True) without the model's zero_grad)
        self.grad_copies = 0
        self._held: dict[int, torch.Tensor] | None = None  # during an empty rank's pass
        self._pass_t0 = 0.0
        self._install(self._layout.plan())
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params)]
        self._accumulator_handles: list = []
        self._hook_accumulators()
        self._register_load_state_dict_pre_hook(accept_module_keys)

    # ------------------------------------------------------------------ layout
    def _install(self, specs: list[BucketSpec]) -> None:
        mask = len(self._params) if self.find_unused_parameters else 0
        self._layout.install(specs, self._reduction, mask)

    def set_reduction(self, reduction: BucketReduction) -> None:
        """Hand bucket communication to ``reduction`` (ZeRO, mixed precision, compression).

        The hooks, launch order, header and ``num_items`` accounting stay here, so
        every reduction keeps DataParallel's exact semantics. The bucket layout is
        frozen from here on (no rebuild), because a reduction may keep state in it
        (ZeRO's shards).
        """
        if self._in_pass:
            raise UsageError("set_reduction() called during backward")
        if self._custom_reduction:
            raise UsageError("this DataParallel already has a reduction strategy "
                             "(is it wrapped by two ZeroOptimizers?)")
        if self._layout.tuning:
            raise UsageError("a custom reduction needs a fixed bucket layout: give "
                             "DataParallel a number for bucket_cap_mb, not 'auto'")
        self._reduction, self._custom_reduction = reduction, True
        reduction.attach(self)
        self._layout.rebuilt = True
        self._arrivals.abandon()
        self._install(self._layout.plan_in_use)

    def layout_state(self) -> dict:
        """The rebuilt bucket layout (the ready order it came from), for a checkpoint."""
        return {"ready_order": self._layout.ready_order if self._layout.rebuilt else None}

    def load_layout_state(self, state: dict | None) -> None:
        """Continue in the saved run's buckets instead of rebuilding after the first pass.

        A fresh run rebuilds its buckets once, in the order gradients became ready in its
        first pass; a resumed process would start in registration order and rebuild
        again. The sums are the same either way, but state a reduction keeps per bucket
        (compression residuals) was built in the saved layout: continued in another,
        it restarts, and the run is no longer the uninterrupted one (measured on the
        built-in GPT with int8: 1.5e-3). Ignored while the cap is being tuned.
        """
        order = (state or {}).get("ready_order")
        if order is None or self._layout.tuning:
            return
        if self._in_pass:
            raise UsageError("load_layout_state() called during backward")
        self._arrivals.abandon()
        self._relayout(self._layout.adopt(order))

    # ------------------------------------------------------------------ core hooks
    def _run_forward(self, args, kwargs):
        if torch.is_grad_enabled():
            self._reduction.prepare()
        return self.module(*args, **kwargs)

    def _param_names(self) -> list[str]:
        return self._names

    def _optimizer_pieces(self):
        return list(zip(self._names, self._params))

    @property
    def owns_shards(self) -> bool:
        return self._reduction.owns_shards

    def _trainable(self) -> list[bool]:
        return [p.requires_grad for p in self._params]

    def _pass_may_start(self, i: int, defined: bool) -> None:
        """Before a gradient is accumulated (``sync/accumulators.py``)."""
        if not self._in_pass:
            self._start_pass()
        if defined:
            self._written[i] = True

    def _hook_accumulators(self) -> None:
        """(Re)register the pre-accumulation hooks on every parameter's accumulator.

        torch replaces a parameter's accumulator when its data changes dtype or device
        (``p.data = p.data.to(torch.bfloat16)``, as mixed precision does after the
        wrapper is built): hooks on the old node never fire again, and a window that
        re-pointed ``.grad`` at a bucket view would read "nothing accumulated"."""
        for h in self._accumulator_handles:
            h.remove()
        self._accumulators, self._accumulator_handles = hook_accumulators(
            self._params, self._pass_may_start)
        self._hooked_as = [(p.dtype, p.device) for p in self._params]

    def _set_aside(self) -> None:
        if [(p.dtype, p.device) for p in self._params] != self._hooked_as:
            self._hook_accumulators()
        self._written = [False] * len(self._params)  # per window, as the views re-pointed
        self._reduction.set_aside()

    def _take_back(self) -> None:
        self._reduction.take_back()

    def _sync_open(self) -> None:
        self._reduction.prepare()
        self._arrivals.open(log_order=not self._layout.rebuilt)
        self._layout.next_launch = 0
        self._pass_t0 = time.perf_counter()
        if not self._layout.header_in_bucket:
            self._launch_header(self.group)

    def _sync_collect(self) -> Collected:
        self._pass_over()
        missing = self._arrivals.never_arrived()
        for i in self._arrivals.incomplete():  # launch so no peer waits on us (zeros if missing)
            bucket, slot = self._layout.where(i)
            if not bucket.is_view(slot):
                self._reduction.ensure(bucket)
                bucket.adopt(slot)
            bucket.pending -= 1
        self._layout.launch_ready(self._reduction, self._window, self._used)
        t_wait = tracing.wait_begins()
        layout = self._layout
        for b in layout.buckets:
            b.handle.wait()
        header = layout.header_slots().clone() if layout.header_in_bucket else self._summed_header()
        tracing.wait_ends(t_wait, buckets=len(layout.buckets))
        used = None
        if self.find_unused_parameters:
            used = (layout.mask_slots(len(self._params)).clone() if layout.mask_in_bucket
                    else self._sum_used(self._used, self.group))
        return Collected(header, used, missing)

    def _sync_complete(self, divisor: float, used: list[bool]) -> None:
        self._used = [False] * len(self._params)
        self._reduction.complete(divisor, used)
        for b in self._layout.buckets:
            b.reset()
            b.zeroed = False  # it holds the global sum now, also where this rank added nothing
        order = self._arrivals.close()
        if order is not None:
            self._relayout(self._layout.rebuild(order))
        elif self._layout.tuning:
            self._relayout(self._layout.autotune_step(time.perf_counter() - self._pass_t0))

    def _synced_grads(self):
        grads, sharded = self._reduction.synced_grads()
        return grads, self.group, sharded

    def _drop_grads(self) -> None:
        self.zero_grad(set_to_none=True)  # the reduction's shards (ZeRO) go with them

    def _relayout(self, specs: list[BucketSpec] | None) -> None:
        if specs is not None:
            self._install(specs)

    def _sync_reset(self) -> None:
        self._arrivals.abandon()
        self._used = [False] * len(self._params)
        self._reduction.reset()
        for b in self._layout.buckets:
            b.reset()

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, buckets={len(self._layout.buckets)}, "
                f"bucket_cap_mb={self.bucket_cap_bytes / 2**20:g}, "
                f"find_unused_parameters={self.find_unused_parameters}")

