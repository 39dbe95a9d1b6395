"""DiLoCo and Local SGD: many local steps, then one exchange of where the replicas went.

DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1): every worker runs
``H`` inner optimizer steps with no communication, then the workers average
their *pseudo-gradient* (the parameters at the last sync minus the parameters
now) and an outer optimizer (SGD, lr 0.7, momentum 0.9, Nesterov: the paper's
choice, section 3) steps a global copy with it; every worker continues from the
global copy. Traffic drops by ``H`` against synchronous data parallelism. Local
SGD (Stich, arXiv 1805.09767; torch's PostLocalSGD) is the special case of an
outer SGD with lr 1 and no momentum: the new global copy is the average of the
replicas.

Weighting, where gradsync differs from both anchors: the paper and torch divide
the summed pseudo-gradients by the number of workers. Here each worker's
pseudo-gradient is weighted by the items it processed since the last sync
(``step(num_items=n)``), so a worker that saw twice the data counts twice, and a
worker that saw none does not count. With ``H = 1``, inner SGD and an outer SGD
of lr 1 this is exactly synchronous data-parallel SGD on the global batch (tested
to 1e-12 in float64 with uneven items); with equal items it is the paper's
average. ``num_items=None`` counts one per step (the paper's weighting when every
worker takes the same steps).

Buffers (BatchNorm running statistics): floating-point buffers are averaged at
every sync with the same item weights (a replica that saw more data has better
statistics); integer buffers (``num_batches_tracked``) take rank 0's value. With
``sync_buffers=False`` they stay local.

Workers may be hosts rather than ranks (``topology=HostTopology(...)``): the DiLoCo
paper's workers are islands of accelerators training synchronously inside, with
local updates only across the slow links between them. The caller makes each host
one replica (``gs.DataParallel(module, group=topology.intra_group)``: exact inside the
host); DiLoCo then sums pseudo-gradients with the two-level all-reduce, so the
inter-host link carries each host's pseudo-gradient once, split over its ranks, and
the item weights add up to each host's items with no extra step.

Nothing here is exact against one process except the ``H = 1`` case above (and a
synchronous warm-up's steps): local updates spend exactness on purpose, and
``gradsync verify`` never calls them exact.

Three options change when syncs happen and how the first outer steps push
(:class:`SyncSchedule`): ``warmup_steps`` (post-local SGD: synchronous steps first),
``outer_momentum_warmup`` (a momentum ramp) and ``sync_every_max`` (H grows as the
inner learning rate decays).

When a local-update run syncs, and how hard its first outer steps push.

DiLoCo at a fixed H from the first step ended 27% above synchronous training at
equal samples on the built-in GPT. The literature's answers for that regime are
each an option here, all off by default (a run without them is the DiLoCo it was,
bit for bit: tested):

1. **Synchronous warm-up** (post-local SGD, Lin et al., arXiv 1808.07217, section 3;
   torch's ``PostLocalSGDOptimizer(start_localSGD_iter=W)``): the first W inner steps
   are exact synchronous data parallelism -- the model's backward sums every
   worker's gradient with its items and divides by the global count (gradsync's
   exact weighting, not DDP's average of means; ``exchange.mean_gradients``), so the
   replicas stay identical through the phase where the loss falls fastest and
   replicas would drift furthest. After step W the global copy is reset to the
   parameters and local steps begin; syncs come every H steps counted from W.
2. **Outer-momentum warm-up**: the outer optimizer's ``momentum`` at a fragment's
   k-th outer step (k = 1, 2, ...) is ``m * min(1, (k - 1) / K)``: 0 at the first,
   ``m`` from step K + 1 on. Why: torch's SGD starts its buffer at the first
   pseudo-gradient, so DiLoCo's first Nesterov step moves ``(1 + m)`` times it
   (1.9 x 0.7 = 1.33 times for the paper's values), from replicas that have only
   just left one point. While the ramped momentum is 0 torch keeps no buffer: the
   buffer starts at k = 2 from that step's pseudo-gradient.
3. **An H that grows as the learning rate decays**: after a sync at step s the
   next comes ``clamp(floor(H * lr_peak / lr_now + 1/2), H, M)`` steps later, where
   ``lr_now`` is the inner learning rate of step s and ``lr_peak`` the largest seen
   so far (so a learning-rate warm-up keeps H). Small steps move the replicas
   apart slowly, so the same drift takes more of them; the Quadratic
   Synchronization Rule (Gu et al., arXiv 2310.14423) grows H as ``(alpha /
   lr)^2`` for the same reason, linear here and capped at M so a schedule decaying
   to 0 still syncs. DiLoCo only: streaming's staggered fragment offsets assume
   one fixed H.

The position in all three (steps since warm-up, next sync, peak learning rate,
each fragment's outer steps) is checkpoint state.

Synchronous warm-up before local steps: post-local SGD (Lin et al., arXiv 1808.07217).

The first W inner steps of a DiLoCo run are exact synchronous data parallelism
(:class:`SyncSchedule` says why): the caller's backward, once its accumulation window
closes, asks :attr:`warming_up` and if so hands the gradient to
:meth:`average_gradients`, which sums every worker's gradient with its items and
divides by the global count -- gradsync's exact weighting, as ``--sync exact``
computes it, not DDP's average of means. Every replica then takes the same inner
step, so they stay bitwise identical (tested). After step W the global copy is
reset to the parameters and DiLoCo's local steps begin.

The hook sits between backward and the optimizer step because that is where
synchronous data parallelism communicates; ``strategy/inexact.py``'s
``LocalModel.backward`` calls it, and so can a hand-written loop. torch's
``PostLocalSGDOptimizer`` does the same with a DDP comm hook that all-reduces
until ``start_localSGD_iter``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UsageError
from ..sync.replicas import broadcast_module_state, verify_same_structure
from ..transport.algorithms.topology import HostTopology
from .exchange import (
    DiLoCoStats,
    Fragment,
    as_items,
    average_buffers,
    build_outer_optimizer,
    default_outer_optimizer,
    mean_gradients,
    resolve_compressor,
    split_parameters,
    sum_with_items,
)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} must be an int >= {low}, got {value!r}")


class SyncSchedule:
    """The steps a DiLoCo run syncs at: warm-up W, interval H (growing up to M), the
    outer momentum ramp over K outer steps (module docstring)."""

    def __init__(self, every: int, warmup: int = 0, momentum_warmup: int = 0,
                 every_max: int = 0):
        _check_int("warmup_steps", warmup, 0)
        _check_int("outer_momentum_warmup", momentum_warmup, 0)
        _check_int("sync_every_max", every_max, 0)
        if every_max and every_max < every:
            raise UsageError(f"sync_every_max ({every_max}) must be 0 (H fixed) or at least "
                             f"sync_every ({every})")
        self.every, self.warmup = every, warmup
        self.momentum_warmup, self.every_max = momentum_warmup, every_max
        self.next_sync = warmup + every  # DiLoCo's next whole-model sync
        self.peak_lr = 0.0

    # ------------------------------------------------------------------ warm-up
    def warming_up(self, steps: int) -> bool:
        """Whether the inner step after ``steps`` completed ones is a synchronous one."""
        return steps < self.warmup

    # ------------------------------------------------------------------ the interval
    def observe(self, lr: float) -> None:
        self.peak_lr = max(self.peak_lr, lr)

    def interval(self, lr: float) -> int:
        """Steps from a sync taken at learning rate ``lr`` to the next one."""
        if not self.every_max:
            return self.every
        if not lr > 0:
            return self.every_max
        grown = math.floor(self.every * self.peak_lr / lr + 0.5)
        return min(self.every_max, max(self.every, grown))

    def due(self, steps: int) -> bool:
        return steps == self.next_sync

    def synced(self, steps: int, lr: float) -> None:
        self.next_sync = steps + self.interval(lr)

    def fragment_due(self, steps: int, offset: int) -> bool:
        """Streaming DiLoCo: fragment with ``offset`` is sent at step ``steps``."""
        return steps > self.warmup and (steps - self.warmup - offset) % self.every == 0

    # ------------------------------------------------------------------ momentum
    def momentum(self, base: float, k: int) -> float:
        """The outer momentum at a fragment's k-th outer step (k >= 1)."""
        if not self.momentum_warmup:
            return base
        return base * min(1.0, (k - 1) / self.momentum_warmup)

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict:
        return {"warmup": self.warmup, "momentum_warmup": self.momentum_warmup,
                "every_max": self.every_max}

    def state_dict(self) -> dict:
        return {**self.config(), "next_sync": self.next_sync, "peak_lr": self.peak_lr}

    def load_state_dict(self, state: dict | None, steps: int, what: str) -> None:
        """``state`` None: a checkpoint from before these options (fixed H, no warm-up)."""
        saved = {k: state[k] for k in self.config()} if state else \
            {"warmup": 0, "momentum_warmup": 0, "every_max": 0}
        if saved != self.config():
            raise UsageError(f"{what}.load_state_dict: saved with {saved}, this one has "
                             f"{self.config()}")
        if state:
            self.next_sync, self.peak_lr = int(state["next_sync"]), float(state["peak_lr"])
        else:
            self.next_sync = steps - steps % self.every + self.every


class SynchronousWarmUp:
    """DiLoCo's warm-up steps (a mixin: it uses DiLoCo's schedule, fragments, group and
    byte counters)."""

    @property
    def warming_up(self) -> bool:
        """Whether the inner step being taken is synchronous (``warmup_steps``): its gradient
        must go through :meth:`average_gradients` before the inner optimizer steps."""
        return self.schedule.warming_up(self._steps)

    def average_gradients(self, weight: float = 1.0, items: float = 1.0) -> None:
        """A warm-up step's gradient: ``sum over workers (weight * .grad) / sum of items``
        (``exchange.mean_gradients``), identical on every rank. Every rank calls it."""
        params = [p for f in self.fragments for p in f.params]
        sent = mean_gradients(params, weight, items, self.group)
        self._bytes += sent
        self._exact_bytes += sent

    def _warmup_step(self) -> bool:
        """Whether the step just counted was a warm-up step; the last one ends the warm-up."""
        if self._steps > self.schedule.warmup:
            return False
        if self._steps == self.schedule.warmup:
            self._end_warmup()
        return True

    def _end_warmup(self) -> None:
        """The replicas are identical: the global copy becomes them, buffers are averaged
        (item-weighted), and the first local interval starts here."""
        items = self.fragments[0].items
        with torch.no_grad():
            for f in self.fragments:
                for a, p in zip(f.anchors, f.params):
                    a.copy_(p)
                f.items, f.last_sent = 0.0, self._steps
        sent = self._sync_buffers(items)
        self._bytes += sent
        self._exact_bytes += sent


class DiLoCo(SynchronousWarmUp):
    """Local inner steps, then an outer step on the item-weighted pseudo-gradient every H steps.

    Args:
        model: a plain ``nn.Module`` replica (same structure on every rank, checked;
            rank 0's parameters and buffers are broadcast at construction).
        inner_optimizer: the optimizer the caller steps every inner step; DiLoCo
            never steps it, but saves and restores it in ``state_dict()``.
        outer_optimizer: ``lambda params: torch.optim.X(params, ...)`` or an optimizer over
            ``model.parameters()``, (re)built over the global copy; default
            SGD(lr=0.7, momentum=0.9, nesterov=True).
        sync_every: H, inner steps between syncs.
        group: process group (default: the world).
        topology: a :class:`HostTopology` (instead of ``group``): a DiLoCo worker per
            host. Replicas must be identical inside a host (DataParallel over
            ``topology.intra_group``); pseudo-gradients travel by the two-level
            all-reduce. Not with ``compress``.
        compress: ``None`` (exact all-reduce), ``"bf16"``, ``"int8"``, ... or a
            :class:`Compressor`; the pseudo-gradient travels compressed.
        sync_buffers: average floating-point buffers at every sync (see module docstring).
        warmup_steps: W, synchronous inner steps before local ones (post-local SGD): while
            :attr:`warming_up`, the caller's backward sums gradients through
            :meth:`average_gradients` (``LocalModel`` does). Default 0.
        outer_momentum_warmup: K, outer steps over which the outer optimizer's
            ``momentum`` ramps from 0 (:class:`SyncSchedule`). Default 0: no ramp.
        sync_every_max: M, the interval grows from H towards M as the inner learning
            rate (``inner_optimizer.param_groups[0]["lr"]``) falls below its peak.
            Default 0: H fixed.

    Every rank calls :meth:`step` once per inner step, the same number of times
    (``num_items=0`` for a worker without data), and :meth:`sync_now` at the end.
    """

    _what = "DiLoCo"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable | None = None, sync_every: int = 500, group=None,
                 compress=None, sync_buffers: bool = True, *, topology=None, _fragments=1,
                 warmup_steps: int = 0, outer_momentum_warmup: int = 0,
                 sync_every_max: int = 0):
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(f"{self._what} needs an initialised process group: call "
                             "gradsync.init() (torchrun) or run inside gradsync.spawn()")
        if not isinstance(model, nn.Module):
            raise UsageError(f"{self._what} takes an nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise UsageError(f"{self._what}: inner_optimizer must be a torch.optim.Optimizer, "
                             f"got {type(inner_optimizer).__name__}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise UsageError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not (outer_optimizer is None or callable(outer_optimizer)
                or isinstance(outer_optimizer, torch.optim.Optimizer)):
            raise UsageError("outer_optimizer must be a factory: lambda params: torch.optim.X("
                             f"params, ...), or an optimizer over the model's parameters, got "
                             f"{type(outer_optimizer).__name__}")
        if topology is not None:
            if not isinstance(topology, HostTopology):
                raise UsageError(f"{self._what}: topology must be a HostTopology, got "
                                 f"{type(topology).__name__}")
            if group is not None or compress is not None:
                raise UsageError(f"{self._what}: topology spans the world and sends exactly: "
                                 "no group or compress with it")
        self.schedule = SyncSchedule(sync_every, warmup_steps, outer_momentum_warmup,
                                     sync_every_max)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.group = group
        self.topology = topology
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.compressor = resolve_compressor(compress)
        self.sync_buffers = bool(sync_buffers)

        verify_same_structure(model, group, what=self._what)
        broadcast_module_state(model, group)
        self.fragments = [Fragment(i, named)
                          for i, named in enumerate(split_parameters(model, _fragments))]
        self.outer_optimizer = build_outer_optimizer(outer_optimizer, self.fragments,
                                                     default_outer_optimizer)
        self._base_momentum = [g.get("momentum") for g in self.outer_optimizer.param_groups]
        if outer_momentum_warmup and None in self._base_momentum:
            raise UsageError(f"{self._what}: outer_momentum_warmup ramps the outer optimizer's "
                             f"momentum; {type(self.outer_optimizer).__name__} has none")
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point() and b.numel()]
        self._other_buffers = [b for b in model.buffers()
                               if not b.is_floating_point() and b.numel()]
        self._steps = 0
        self._syncs = 0
        self._bytes = 0
        self._exact_bytes = 0
        self._last_sync_bytes = 0

    # ------------------------------------------------------------------ the loop
    def step(self, num_items=None) -> None:
        """Call after every inner optimizer step; ``num_items``: items this worker used in it."""
        n = as_items(num_items)
        self._steps += 1
        self.schedule.observe(self._lr())
        for f in self.fragments:
            f.items += n
        if self._warmup_step():
            return
        if self.schedule.due(self._steps):
            self._sync_all()

    def sync_now(self) -> None:
        """Sync whatever moved since the last sync (the end of training); every rank calls it."""
        if self._steps < self.schedule.warmup:  # replicas already identical; buffers averaged
            self._end_warmup()
        elif self._steps != self.fragments[0].last_sent:
            self._sync_all()

    def _sync_all(self) -> None:
        buffer_items = self.fragments[0].items
        for frag in self.fragments:
            items, flat = frag.items, frag.pack()
            frag.items, frag.last_sent = 0.0, self._steps
            flat, total, sent, exact = self._reduce(frag.index, frag.shapes, flat, items,
                                                    self.topology or self.group, self._steps)
            self._apply(frag, flat, total, alpha=0.0)
            extra = self._sync_buffers(buffer_items) if frag.index == 0 else 0
            self._count(sent + extra, exact + extra)
        self.schedule.synced(self._steps, self._lr())

    def _apply(self, frag: Fragment, flat, total: float, alpha: float, merge=True) -> None:
        """The fragment's outer step, its momentum ramped (``outer_momentum_warmup``)."""
        if self.schedule.momentum_warmup and total > 0:
            for g, base in zip(self.outer_optimizer.param_groups, self._base_momentum):
                g["momentum"] = self.schedule.momentum(base, frag.outer_steps + 1)
        frag.apply(flat, total, self.outer_optimizer, alpha, merge)

    def _lr(self) -> float:
        return float(self.inner_optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ communication
    def _reduce(self, key: int, shapes, flat: torch.Tensor, items: float, group, step=None):
        """``exchange.sum_with_items`` with this DiLoCo's compressor (streaming calls it on a
        thread: it touches only its arguments and the compressor)."""
        return sum_with_items(self.compressor, key, shapes, flat, items, group, step)

    def _sync_buffers(self, items: float) -> int:
        """Item-weighted average of float buffers, rank 0's integer buffers; bytes sent."""
        if not self.sync_buffers:
            return 0
        return average_buffers(self._float_buffers, self._other_buffers, items, self.group)

    def _count(self, sent: int, exact: int) -> None:
        self._bytes += sent
        self._exact_bytes += exact
        self._last_sync_bytes = sent
        self._syncs += 1

    # ------------------------------------------------------------------ reporting, checkpoints
    def stats(self) -> DiLoCoStats:
        return DiLoCoStats(self._steps, self._syncs, self._bytes, self._exact_bytes,
                           self._last_sync_bytes)

    @property
    def steps(self) -> int:
        """Inner steps taken (``step()`` calls)."""
        return self._steps

    @property
    def replicas_agree(self) -> bool:
        """Whether every replica holds the same parameters after the step just counted (a
        sync, or a synchronous warm-up step; streaming's merges leave them apart)."""
        return self._steps <= self.schedule.warmup or self.fragments[0].last_sent == self._steps

    def state_dict(self) -> dict:
        """Everything besides the model to continue bit for bit: global copy, outer and inner
        optimizer state, step counter, item counts, compressor residuals, statistics.

        Per rank (item counts and residuals differ): every rank saves its own, next
        to the model's ``state_dict()``.
        """
        return {
            "kind": self._what, "sync_every": self.sync_every, "steps": self._steps,
            "anchors": [[a.detach().clone() for a in f.anchors] for f in self.fragments],
            "items": [f.items for f in self.fragments],
            "last_sent": [f.last_sent for f in self.fragments],
            "outer_steps": [f.outer_steps for f in self.fragments],
            "sync_schedule": self.schedule.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "inner": self.inner_optimizer.state_dict(),
            "compressor": None if self.compressor is None else self.compressor.state_dict(),
            "stats": [self._syncs, self._bytes, self._exact_bytes, self._last_sync_bytes],
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != self._what:
            got = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise UsageError(f"{self._what}.load_state_dict: not a {self._what} state ({got!r})")
        if state["sync_every"] != self.sync_every:
            raise UsageError(f"{self._what}.load_state_dict: saved with sync_every="
                             f"{state['sync_every']}, this one has {self.sync_every}")
        saved = [[tuple(a.shape) for a in f] for f in state["anchors"]]
        mine = [[tuple(a.shape) for a in f.anchors] for f in self.fragments]
        if saved != mine:
            raise UsageError(f"{self._what}.load_state_dict: the saved global copy has shapes "
                             f"{saved}, this model {mine}")
        if (state["compressor"] is None) != (self.compressor is None):
            raise UsageError(f"{self._what}.load_state_dict: saved "
                             f"{'with' if state['compressor'] else 'without'} compression, "
                             f"this one is {'with' if self.compressor else 'without'}")
        self.schedule.load_state_dict(state.get("sync_schedule"), int(state["steps"]),
                                      self._what)
        for f, k in zip(self.fragments, state.get("outer_steps", [0] * len(self.fragments))):
            f.outer_steps = int(k)
        with torch.no_grad():
            for f, anchors in zip(self.fragments, state["anchors"]):
                for a, v in zip(f.anchors, anchors):
                    a.copy_(v)
        for f, items, last in zip(self.fragments, state["items"], state["last_sent"]):
            f.items, f.last_sent = float(items), int(last)
        self.outer_optimizer.load_state_dict(state["outer"])
        self.inner_optimizer.load_state_dict(state["inner"])
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        self._steps = int(state["steps"])
        self._syncs, self._bytes, self._exact_bytes, self._last_sync_bytes = state["stats"]
