"""Strategies that spend exactness on purpose: compressed buckets and local updates.

Both plug into :class:`~gradsync.engine.strategy.base.Strategy` without touching the
training loop: ``build_strategy(..., sync=SyncOptions(...))`` returns one.

* :class:`CompressedStrategy`: DataParallel whose buckets travel through a
  compressor (``compress/``) after the first, exact, window; every
  ``probe_every`` steps the exact gradient is summed too, and the step reports
  how far the compressed one was (cosine, relative error).
* :class:`LocalUpdateStrategy`: DiLoCo / Streaming DiLoCo (arXiv 2311.08105,
  2501.18512). The model is a :class:`LocalModel` (no gradient communication;
  ``backward(loss, num_items)`` gives this worker's exact local mean), the loop's
  optimizer is the inner one, and :meth:`after_step` hands the worker's items to
  DiLoCo, which syncs every H steps.

Their per-worker state (compressor residuals; a local-update worker's replica,
inner optimizer and item counts, which differ between syncs) is gathered into the
checkpoint, so a run continues where it stopped. A local-update run resumes on
the same number of workers only: per-worker replicas cannot be re-split.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ...dist import comm_device
from ...errors import UsageError
from ..compress.base import ring_bytes
from ..compress.delayed import DelayedUpdates
from ..replicated.data_parallel import DataParallel
from ..replicated.memory_report import MemoryReport, held, optimizer_bytes
from ..sync.item_window import as_count
from ..transport import comm, host
from .base import Strategy
from .exact import DataParallelStrategy


def _gather_objects(obj) -> list:
    return comm.all_gather_object(obj, tag="per-rank-state")  # tensors travel via the host


class _PerRankState:
    """Per-worker state into the checkpoint: gathered while every rank takes part
    (``full_state_dict`` is a collective), written by rank 0 in ``extra_state``."""

    _gathered: list | None = None

    def per_rank_state(self) -> dict:
        raise NotImplementedError

    def load_per_rank_state(self, state: dict) -> None:
        raise NotImplementedError

    def gather_state(self) -> None:
        self._gathered = _gather_objects(self.per_rank_state())

    def extra_state(self) -> dict:
        return {"ranks": self._gathered}

    def load_extra_state(self, state: dict) -> None:
        ranks = (state or {}).get("ranks")
        if ranks is None:
            return
        if len(ranks) != dist.get_world_size():
            self.resume_on_new_world(len(ranks))
            return
        # a checkpoint loads on the host: this rank's state goes to the device first
        self.load_per_rank_state(host.to_device(ranks[dist.get_rank()], comm_device()))

    def resume_on_new_world(self, was: int) -> None:
        pass


class CompressedStrategy(DelayedUpdates, _PerRankState, DataParallelStrategy):
    """``ddp`` with compressed buckets (``--compress``; ``--compress-delay 1``: applied one
    step late, ``delayed.py``)."""

    def __init__(self, name, precision, model, optimizer, reduction):
        super().__init__(name, precision, model, optimizer)
        self.reduction = reduction
        self._sent = 0

    def full_state_dict(self) -> dict:
        self.gather_state()
        return super().full_state_dict()

    def per_rank_state(self) -> dict:
        return {"compressor": self.reduction.compressor.state_dict(),
                "windows": self.reduction.windows, "layout": self.model.layout_state()}

    def load_per_rank_state(self, state: dict) -> None:
        self.model.load_layout_state(state.get("layout"))  # the residuals' buckets
        self.reduction.compressor.load_state_dict(state["compressor"])
        self.reduction.windows = state["windows"]

    def resume_on_new_world(self, was: int) -> None:
        self.reduction.windows = self.reduction.exact_windows  # residuals restart at zero

    def memory_report(self) -> MemoryReport:
        """DataParallel's, and the compressor's error-feedback residuals beside it."""
        return dataclasses.replace(super().memory_report(),
                                   residuals=self.reduction.compressor.held_bytes())

    def step_report(self) -> dict:
        if self.reduction.delayed is not None:
            return self.delayed_report()
        stats = self.reduction.compressor.stats()
        sent, self._sent = stats.sent_bytes - self._sent, stats.sent_bytes
        if not sent:  # an exact window (the first): what its all-reduces put on the wire
            sent = sum(ring_bytes(b.spec.nbytes, dist.get_world_size())
                       for b in self.model.buckets)
        report = {"sent_bytes": sent}
        if self.reduction.last_distance is not None:
            report["grad_cosine"], report["grad_rel_error"] = self.reduction.last_distance
            self.reduction.last_distance = None
        return report


class LocalModel(nn.Module):
    """A replica trained without gradient communication.

    ``backward(loss, num_items=n)`` and ``no_sync()`` as DataParallel's, but the
    window closes locally: the accumulated sum is divided by this worker's own
    item count, the exact mean over what this worker saw. While ``outer`` (the
    DiLoCo, set by :class:`LocalUpdateStrategy`) is in its synchronous warm-up
    (post-local SGD, ``engine/local/diloco.py``) the window closes globally
    instead: sums and items over every worker, as exact data parallelism.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._require_sync = True
        self._items = 0.0
        self.window_items = 0  # items of the last closed window (this worker)
        self.outer = None  # the DiLoCo asked whether a step is a synchronous warm-up step

    def _warming_up(self) -> bool:
        return self.outer is not None and self.outer.warming_up

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def backward(self, loss=None, num_items=None, **kwargs) -> None:
        n = 1.0 if num_items is None else as_count(num_items)
        if num_items is None:
            loss.backward(**kwargs)
        elif n:
            (loss * n).backward(**kwargs)
        self._items += n
        if self._require_sync:
            if self._warming_up():  # sums (or, without num_items, means) over every worker
                self.outer.average_gradients(1.0, self._items if num_items is not None else 1.0)
            elif num_items is not None and self._items:
                with torch.no_grad():
                    for p in self.module.parameters():
                        if p.grad is not None:
                            p.grad.div_(self._items)
            self.window_items, self._items = int(self._items), 0.0


class HostModel(LocalModel):
    """A local-update worker that spans a host: exact data parallelism over the host's
    ranks (a DataParallel on ``group``, the host's intra group), local updates across
    hosts, as the DiLoCo paper's workers are islands of accelerators.

    ``window_items`` stays this rank's own items: DiLoCo sums item-weighted
    pseudo-gradients over every rank, and the ranks of a host hold one replica, so
    the sum weights each host by its items.
    """

    def __init__(self, module: nn.Module, group, bucket_cap_mb: float = 25.0):
        super().__init__(module)
        # not a registered child: parameters and state_dict stay the module's own
        object.__setattr__(self, "replica", DataParallel(module, group=group,
                                                         bucket_cap_mb=bucket_cap_mb))

    def forward(self, *args, **kwargs):
        return self.replica(*args, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.replica.train(mode)
        return self

    @contextlib.contextmanager
    def no_sync(self):
        with self.replica.no_sync(), super().no_sync():
            yield

    def backward(self, loss=None, num_items=None, **kwargs) -> None:
        self.replica.backward(loss, num_items=num_items, **kwargs)
        self._items += 1.0 if num_items is None else as_count(num_items)
        if self._require_sync:
            if self._warming_up():  # the host's exact mean, weighted by this rank's items
                weight = self._items if num_items is not None else 1.0
                self.outer.average_gradients(weight, weight)
            self.window_items, self._items = int(self._items), 0.0


class LocalUpdateStrategy(_PerRankState, Strategy):
    """``--sync diloco | streaming-diloco``: inner steps here, outer steps in DiLoCo."""

    replicated = False
    not_replicated_because = "replicas differ between syncs by design"
    bucket_plan = ()
    bucket_cap_mb = None
    autotune_result = None

    def __init__(self, name, precision, model: LocalModel, optimizer, diloco):
        super().__init__(name, precision, model, optimizer)
        self.diloco = diloco
        model.outer = diloco  # its backward asks whether a step is a synchronous warm-up one
        self._sent = 0

    def after_step(self, num_items: int) -> None:
        self.diloco.step(num_items=self.model.window_items)

    def finish(self) -> None:
        self.diloco.sync_now()  # the run ends with one model on every worker

    def step_report(self) -> dict:
        stats = self.diloco.stats()
        sent, self._sent = stats.bytes_sent - self._sent, stats.bytes_sent
        return {"sent_bytes": sent, "one_model": self.one_model()}

    def one_model(self) -> bool:
        """Whether every replica holds the same parameters after the step just taken:
        after a DiLoCo sync, a synchronous warm-up step, or the run's final sync, so a
        held-out loss then is one model's (streaming merges fragments into replicas that
        stay apart)."""
        return self.diloco.replicas_agree  # streaming's: warm-up steps and its final sync

    def memory_report(self) -> MemoryReport:
        module, opt = self.model.module, self.optimizer
        params = sum(held(p) for p in module.parameters())
        grads = sum(held(p.grad) for p in module.parameters())
        state = sum(optimizer_bytes(opt, p, p.numel())[0] for p in module.parameters())
        anchors = [a for f in self.diloco.fragments for a in f.anchors]
        outer = sum(optimizer_bytes(self.diloco.outer_optimizer, a, a.numel())[0]
                    for a in anchors)
        num = sum(p.numel() for p in module.parameters() if p.requires_grad)
        residuals = self.diloco.compressor.held_bytes() if self.diloco.compressor else 0
        return MemoryReport(0, dist.get_world_size(), num, params, grads, 0, state + outer, 0,
                            0, outer_copy=sum(held(a) for a in anchors), residuals=residuals,
                            strategy=self.name)

    # ----------------------------------------------------------------- checkpoints
    def full_state_dict(self) -> dict:
        self.gather_state()
        return dict(self.model.module.state_dict())

    def optimizer_state_dict(self) -> dict | None:
        return None  # per worker: inside the gathered extra state

    def load_optimizer_state_dict(self, state) -> None:
        pass

    def per_rank_state(self) -> dict:
        return {"module": {k: v.detach().clone() for k, v in
                           self.model.module.state_dict().items()},
                "diloco": self.diloco.state_dict()}

    def load_per_rank_state(self, state: dict) -> None:
        self.model.module.load_state_dict(state["module"])
        self.diloco.load_state_dict(state["diloco"])

    def resume_on_new_world(self, was: int) -> None:
        raise UsageError(f"a {self.name} run resumes on the number of workers that wrote it "
                         f"({was}; this run has {dist.get_world_size()}): between syncs every "
                         "worker holds its own replica and inner optimizer state")
