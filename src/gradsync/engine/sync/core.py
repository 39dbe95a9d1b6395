"""One synchronised backward for every strategy: the pass state machine and its rules.

DataParallel (alone or under ZeroOptimizer) and FullyShardedDataParallel differ
in how gradients travel -- buckets all-reduced, buckets reduced to shards, units
reduce-scattered -- but not in *when* they travel or *what* a user gets back.
That part lives here, once: ``backward(loss, num_items)``, ``no_sync()``, the
forward-time sync decision, output hooks, the item window, buffer broadcasts and
the end-of-backward callback. A strategy subclasses :class:`SyncedModule` and
supplies the mechanics (``_run_forward``, ``_sync_open``, ``_sync_collect``,
``_sync_complete``, ``_set_aside``/``_take_back``, ``_replay_*``: the hooks listed
in ``protocol.py``).

The rules a user switching from torch DDP (arXiv 2006.15704) may rely on; the
only intended difference is the divisor (the global item count with
``num_items``, DDP's world size without):

1. A parameter that got no gradient on *any* rank in the accumulation window ends
   the sync with ``.grad`` as it was before (None after ``zero_grad(set_to_none=
   True)``), so weight decay and momentum leave it alone as they do in one
   process; one used on some ranks only counts as zero on the others. Knowing
   "no rank" takes a used-mask all-reduce, which DDP also pays and only with
   ``find_unused_parameters=True``; without it an unused parameter is an error
   naming it. A parameter frozen after wrapping (``requires_grad=False``) simply
   takes no part.
2. Gradients already in ``.grad`` when a window starts (a user who syncs every
   micro-step and steps every second one) are set aside before autograd can
   accumulate into them and added back after the sync: only this window's
   contribution is summed and divided by its global count.
3. A pass that no parameter joins (``torch.autograd.grad`` on the output for a
   gradient penalty) issues no collective and is not an error; the forward's
   sync decision survives it for the backward that follows.
4. Buffers move exactly when DDP moves them: broadcast from rank 0 before a
   forward that follows a synchronised grad-enabled forward (the first forward
   too), whether training or evaluating.
5. A rank with no data joins with ``backward(loss_or_None, num_items=0)``, whether
   it ran the forward or not; it replays the collectives with zeros and counts
   as "not used" for rule 1.
6. Inputs that run out at different iterations: ``model.join()`` (``join.py``).

With loss scaling (fp16, ``loss_scale.py``) the scale is applied here too:
``backward(loss, num_items=n)`` multiplies by ``n * scale``, the sync divides by the
global count times the scale, and the end of the sync reads one overflow flag and
drops the gradients of an overflowed step on every rank alike.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ...dist import comm_device
from ...errors import UnusedParametersError, UsageError
from ..transport import comm, host, tracing
from .item_window import WINDOW_SLOTS, CheckedWindow, as_count
from .join import Join, Shadow
from .loss_scale import LossScale, LossScaler
from .protocol import SyncProtocol, tensors_in
from .replicas import broadcast_tensors, check_module_device


class SyncedModule(Shadow, SyncProtocol, nn.Module):
    """The shared core of DataParallel and FullyShardedDataParallel (see module docstring)."""

    def __init__(self, module: nn.Module, group, find_unused_parameters: bool,
                 broadcast_buffers: bool, what: str):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(f"{what} needs an initialised process group: call "
                             "gradsync.init() (torchrun) or run inside gradsync.spawn()")
        if not isinstance(module, nn.Module):
            raise UsageError(f"{what} wraps an nn.Module, got {type(module).__name__}")
        check_module_device(module, group, what)
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._require_sync = True
        self._forward_sync: bool | None = None  # decided by the last grad-enabled forward
        self._buffers_due = True  # DDP's require_forward_param_sync, True before any forward
        self._in_pass = self._joined = self._syncing = self._empty = False
        self._forward_ran = False  # a grad-enabled forward since the last joined pass
        self._guard_nonfinite = False  # an empty rank's backward through its graph
        self._window = CheckedWindow(self.world_size, self.rank, self)  # + desync fingerprint
        self._window_joined = False  # a pass of the open accumulation window joined
        self._trace_t0: float | None = None
        self._header_buf = torch.zeros(WINDOW_SLOTS, dtype=torch.float64,
                                       device=comm_device(group))
        self._header_pending: comm.Pending | None = None
        self._join_state: Join | None = None  # the open join() context
        self.loss_scaler: LossScaler | None = None  # fp16's loss scale (use_loss_scale)
        self._warned_fp16_loss = False

    def use_loss_scale(self, config: LossScale) -> LossScaler:
        """Scale the loss in :meth:`backward` and divide it out at the sync (``loss_scale.py``).

        Called by what builds the fp32 masters (MixedPrecisionOptimizer, ZeroOptimizer,
        FullyShardedDataParallel) when its ``MixedPrecision`` carries a ``loss_scale``.
        """
        if self.loss_scaler is not None:
            raise UsageError("this model already has a loss scale (wrapped by two optimizers "
                             "with mixed precision?)")
        if self._in_pass or self._window_joined:
            raise UsageError("use_loss_scale() called inside an accumulation window: "
                             "build the optimizer before the first backward")
        self.loss_scaler = LossScaler(config)
        return self.loss_scaler

    # ------------------------------------------------------------ small collectives
    def _launch_header(self, group) -> None:
        """The window's item header and desync fingerprint as a 104-byte all-reduce of
        its own, launched as the first gradient arrives so it hides behind backward
        (when it cannot ride in a bucket that is summed exactly)."""
        self._window.write(self._header_buf, group)
        self._header_pending = comm.all_reduce(self._header_buf, group, async_op=True,
                                               tag="header")

    def _summed_header(self) -> torch.Tensor:
        self._header_pending.wait()
        self._header_pending = None
        return self._header_buf.clone()

    def _sum_used(self, used: list[bool], group) -> torch.Tensor:
        """Rule 1's used mask summed over the ranks (what DDP's find_unused_parameters
        also pays: one small all-reduce once every gradient collective is out)."""
        mask = torch.tensor(used, dtype=torch.float32, device=self._header_buf.device)
        comm.all_reduce(mask, group, tag="used_mask")
        return mask

    # ------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        tracer = tracing.ACTIVE
        t0 = tracing.now() if tracer is not None else 0.0
        grad_on = torch.is_grad_enabled()
        if self._join_config.enable:  # inside torch's Join([model]) context
            self._notify_torch_join()
        if self._join_state is not None:
            self._join_state.notify(grad_on, self._require_sync, self._buffers_due)
        self._sync_buffers()
        if grad_on and not self._in_pass:
            self._forward_sync = self._require_sync
            self._forward_ran = True
        out = self._run_forward(args, kwargs)
        if grad_on:
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self._output_hook)
        self._buffers_due = grad_on and self._require_sync
        if tracer is not None:
            tracer.record("forward", "compute", t0, tracing.now(), sync=self._require_sync)
        return out

    def _sync_buffers(self) -> None:
        """Rule 4: rank 0's buffers, when DDP would broadcast them (before this forward)."""
        if self._buffers_due and self.broadcast_buffers and self.world_size > 1:
            buffers = self._synced_buffers()
            if buffers:  # inside join(): from the highest rank with data, as DDP does
                src = 0 if self._join_state is None else self._join_state.buffer_source
                broadcast_tensors(buffers, self.group, src_rank=src, tag="buffers")

    def _output_hook(self, grad):
        self._start_pass(through_output=True)
        return None

    # ------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor | None = None, num_items=None,
                 **backward_kwargs) -> None:
        """Backward with the exact global mean when ``num_items`` is given.

        ``loss`` is the mean over this micro-batch's ``num_items`` items (samples or
        tokens). With ``num_items=0`` the loss is ignored (it may be ``None`` or NaN,
        as a mean over nothing is) and this rank joins the synchronisation with a
        zero contribution, so ranks with uneven data never leave others waiting;
        the forward may have run or not. Without ``num_items`` this is
        ``loss.backward()``: DDP's convention (divide by the world size).

        With a loss scale (fp16) the loss is multiplied by ``num_items * scale`` here and
        the scale divided out at the sync, exactly (a power of two); ``num_items`` is
        then required.
        """
        scaler = self.loss_scaler
        if num_items is None:
            if loss is None:
                raise UsageError(
                    "backward() needs a loss (or num_items=0 for an empty micro-batch)")
            if scaler is not None:
                raise UsageError(_PLAIN_UNDER_SCALING)
            loss.backward(**backward_kwargs)
            return
        n = as_count(num_items)
        if self._in_pass:
            raise UsageError("backward() called while another backward through this model "
                             "is running")
        if n and loss is None:
            raise UsageError(f"backward() got num_items={num_items} but no loss")
        with self._window.item_pass(n):
            if n == 0:
                self._empty_pass(loss, backward_kwargs)
            elif scaler is None:
                (loss * n).backward(**backward_kwargs)
            else:
                self._scaled(loss, n * scaler.scale).backward(**backward_kwargs)

    def _scaled(self, loss: torch.Tensor, factor: float) -> torch.Tensor:
        """``loss * factor`` in at least fp32 (an fp16 product overflows at once). The
        gradient reaching an fp16 loss is still ``factor`` rounded to fp16, which
        overflows past 65504: the loss belongs in fp32 (arXiv 1710.03740, section 3.3:
        reductions such as a softmax cross-entropy in fp32)."""
        if loss.dtype == torch.float16 and not self._warned_fp16_loss:
            self._warned_fp16_loss = True
            warnings.warn("gradsync: the loss is float16; with loss scaling its gradient "
                          "(num_items * scale) overflows fp16 and the scale backs off far "
                          "below what the model needs. Compute the loss in float32, e.g. "
                          "F.cross_entropy(logits.float(), y)", stacklevel=3)
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * factor

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally with no gradient communication at all.

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

    # ------------------------------------------------------------ pass state machine
    def _start_pass(self, queue: bool = True, through_output: bool = False) -> None:
        """A backward reached this model: from a forward's output, or (a strategy's
        hook) before a parameter's first gradient is accumulated. Synchronised as the
        last forward decided; with no forward since the last pass, only a backward
        through an earlier forward's outputs (a retained graph) is: one through
        ``model.module`` called directly accumulates locally, as in torch DDP."""
        if self._in_pass:
            return
        self._in_pass, self._joined = True, False
        self._trace_t0 = tracing.now() if tracing.ACTIVE is not None else None
        if queue:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        sync = self._forward_sync
        if sync is None:
            sync = self._require_sync and through_output
        self._syncing = sync
        if not self._window_joined:
            self._set_aside()
        self._pass_started()

    def _join(self) -> None:
        """A parameter's gradient arrived (called by the strategy's hooks, first thing)."""
        if not self._in_pass:
            self._start_pass()
        if self._joined:
            return
        self._joined = True
        self._window_joined = True
        self._window.pass_joined()
        if self._syncing:
            self._sync_open()

    def _end_pass(self) -> None:
        joined, sync = self._joined, self._syncing
        try:
            if not joined:
                if not self._window_joined:
                    self._take_back()
            elif sync:
                self._finish_sync()
        finally:
            self._in_pass = self._joined = self._syncing = False
            if joined:
                self._forward_sync, self._forward_ran = None, False
            self._pass_over()
            self._window.pass_ended()
            if self._trace_t0 is not None and tracing.ACTIVE is not None:
                tracing.ACTIVE.record("backward", "compute", self._trace_t0, tracing.now(),
                                      sync=sync)
            self._trace_t0 = None

    def _finish_sync(self) -> None:
        collected = self._sync_collect()
        self._window_joined = False
        trainable = self._trainable()
        missing = [i for i in collected.missing if trainable[i]]
        if missing and not self.find_unused_parameters:
            self._window.reset()
            self._sync_reset()
            names = self._param_names()
            listed = ", ".join(repr(names[i]) for i in missing)
            raise UnusedParametersError(
                f"rank {self.rank}: {len(missing)} parameter(s) received no gradient in this "
                f"synchronised backward: {listed}. Make every parameter take part in the loss, "
                "freeze them (requires_grad=False), or pass find_unused_parameters=True "
                "(gradsync train --find-unused-parameters): a parameter no rank used then "
                "keeps its .grad (None) as in torch DDP")
        try:
            divisor = self._window.close(collected.header, None if self._join_state is None
                                         else self._join_state.plain_divisor())
        except UsageError:
            self._sync_reset()
            raise
        scaler = self.loss_scaler
        if scaler is not None and self._window.closed_plain:  # the same sums on every rank
            self._sync_reset()
            raise UsageError(_PLAIN_UNDER_SCALING)
        if collected.used is not None:
            used = [bool(u > 0) for u in host.read(collected.used).tolist()]
        else:
            used = [True] * len(trainable)
        used = [u and t for u, t in zip(used, trainable)]
        if scaler is None:
            self._sync_complete(divisor, used)
            return
        self._sync_complete(divisor * scaler.scale, used)  # exact: a power of two
        if scaler.record(self._synced_grads_finite()) != "finite":
            self._drop_grads()

    def _synced_grads_finite(self) -> bool:
        """Whether the synchronised gradient is finite everywhere, the same answer on every
        rank: one device flag, read once per sync (summed over the group when sharded)."""
        grads, group, sharded = self._synced_grads()
        flag = torch.zeros(1, dtype=torch.float64, device=self._header_buf.device)
        for g in grads:
            flag += g.sum(dtype=torch.float64)  # inf and NaN survive a sum; finite cannot overflow
        if sharded:
            comm.all_reduce(flag, group, tag="overflow")
        return math.isfinite(float(host.read(flag)[0]))


_PLAIN_UNDER_SCALING = (
    "with loss scaling (fp16) the engine scales the loss: call model.backward(loss, "
    "num_items=n) on every rank and micro-step (a plain loss.backward() is not scaled, "
    "and its gradient would be divided by the scale all the same)")
