"""Strategy: one object for "how this run synchronises", whatever the way.

``gradsync train --strategy ddp|zero1|zero2|zero3 --precision fp32|bf16|fp16`` maps its
flags one-to-one onto :func:`~gradsync.engine.strategy.registry.build_strategy`,
which returns a :class:`Strategy`. The training loop, checkpoints and reports talk
to that object only, so none of them probes types: the model (``backward(loss,
num_items=n)`` and ``no_sync()`` with DataParallel's exact semantics), the
optimizer (a ``torch.optim.Optimizer``, so LR schedulers work), the global
gradient norm and clipping, the memory report, what a checkpoint saves and how,
whether replicas are identical (so a drift check means something), and the
bucket plan.

The extension points are the ones the inexact strategies (``inexact.py``:
compressed buckets; DiLoCo's local updates, arXiv 2311.08105, section 2) use: a
subclass gives a ``model`` whose ``backward`` does its own (or no)
communication, does its outer step in :meth:`Strategy.after_step`, keeps what it
needs across restarts in :meth:`extra_state` / :meth:`load_extra_state` (saved
in ``checkpoint.pt``), and says ``replicated = False`` while replicas may
differ. ``register_strategy`` (``registry.py``) adds one under a name that
``--strategy`` then accepts; the loop does not change.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import UsageError
from ..replicated.memory_report import MemoryReport, report_data_parallel
from ..sharded.clip import clip_grad_norm_ as _clip
from ..sync.loss_scale import LossScaler


class Strategy:
    """A wrapped model and its optimizer, plus everything a loop asks of them.

    Attributes:
        name: the registry name (``ddp``, ``zero2``, ...).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        model: the wrapped model: ``model(x)``, ``model.backward(loss, num_items=n)``,
            ``model.no_sync()``, ``model.module`` (the unwrapped module).
        optimizer: steps the parameters this rank updates.
        replicated: every rank holds identical full parameters after a step (so a
            cross-rank drift check is meaningful and rank 0's copy is the model).
        not_replicated_because: when not, why (the run summary says it).
        collectives: how the sums travelled, ``--collectives auto`` decided (``native``,
            ``hierarchical``, ...; the run summary says it); None if the builder
            does not say.

    ``model, optimizer = build_strategy(...)`` still works: a Strategy unpacks
    into that pair.
    """

    replicated = True
    not_replicated_because = "ranks hold different parameters"
    collectives: str | None = None

    def __init__(self, name: str, precision: str, model, optimizer):
        self.name, self.precision = name, precision
        self.model, self.optimizer = model, optimizer

    def __iter__(self):
        return iter((self.model, self.optimizer))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.precision})"

    @property
    def module(self) -> nn.Module:
        return self.model.module

    # ----------------------------------------------------------------- training
    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16's loss scale (``engine/sync/loss_scale.py``): its ``verdict`` says whether
        the last synchronised backward overflowed (its gradients were then dropped, on
        every rank). None without loss scaling."""
        return getattr(self.model, "loss_scaler", None)

    def _clip_target(self):
        return self.model

    def shard_owner(self):
        """What holds this rank's shard of the synchronised gradient (``grad_shards()``, and
        ``grad_used()``/``set_grad_used()`` where unused parameters are tracked), or None
        when every rank holds the whole gradient. A sum beyond this process group adds each
        rank's own shard (replica groups, ``ft/cross_reduce.py``)."""
        return None

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (of the synchronised gradient), clipped to ``max_norm``.

        ``None``, 0 or ``inf`` only measure it (the norm is what a non-finite check
        reads). Sharded gradients sum their squared norms with one all-reduce, so
        every rank gets the same number. After a sync loss scaling found non-finite
        (its gradients dropped): inf, with no work and no collective.
        """
        scaler = self.loss_scaler
        if scaler is not None and scaler.dropped:
            return torch.full((), math.inf, device=self.model._header_buf.device)
        limit = math.inf if not max_norm else float(max_norm)
        return _clip(self._clip_target(), limit)

    def zero_grad(self) -> None:
        """After a step: every gradient to None, as ``optimizer.zero_grad(set_to_none=True)``
        (what the training loop calls; a strategy whose gradients live in buckets zeroes
        them in place as well, so the next backward writes into them without a copy)."""
        self.optimizer.zero_grad(set_to_none=True)

    def after_step(self, num_items: int) -> None:
        """Called after every optimizer step (not after a skipped one), on every rank.

        ``num_items`` is the global item count of the step. Exact synchronisation
        has nothing to do here; a local-update method does its outer step here.
        """

    def finish(self) -> None:
        """Called once after the run's last step, before its final checkpoint, on every
        rank (a local-update method syncs the replicas one last time)."""

    def step_report(self) -> dict:
        """Figures of the step just taken for its metrics line, beyond what the loop
        measures: ``sent_bytes`` (this rank, on the wire), and for compressed
        gradients on probed steps ``grad_cosine`` / ``grad_rel_error`` against the
        exact gradient. Empty for exact synchronisation."""
        return {}

    # ----------------------------------------------------------------- reports
    def memory_report(self) -> MemoryReport:
        return report_data_parallel(self.model, self.optimizer)

    @property
    def bucket_plan(self) -> tuple:
        """The gradient buckets in use (after the first step's rebuild); () if none."""
        return tuple(self.model.bucket_plan)

    @property
    def bucket_cap_mb(self) -> float | None:
        return self.model.bucket_cap_bytes / 2**20

    @property
    def autotune_result(self):
        """What ``bucket_cap_mb="auto"`` measured and chose (None: a fixed cap)."""
        return self.model.autotune_result

    # ----------------------------------------------------------------- checkpoints
    @property
    def checkpoint_target(self) -> tuple | None:
        """``(target, optimizer)`` for ``sharded/checkpoint.py``'s save/load, or
        None when the optimizer state is whole on every rank (saved by rank 0)."""
        return None

    def full_state_dict(self) -> dict:
        """The unwrapped module's full state (no ``module.`` prefix). May be a collective:
        every rank calls it."""
        return dict(self.model.module.state_dict())

    def load_full_state_dict(self, state: dict) -> None:
        self.model.module.load_state_dict(state)

    def optimizer_state_dict(self) -> dict | None:
        return None if self.checkpoint_target else self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def extra_state(self) -> dict:
        """Strategy state beyond model and optimizer (saved by rank 0: keep it identical
        on every rank). For exact synchronisation only the loss scale, with fp16 (every
        rank's is the same: the verdicts agree)."""
        scaler = self.loss_scaler
        return {"loss_scale": scaler.state_dict()} if scaler is not None else {}

    def load_extra_state(self, state: dict) -> None:
        state = dict(state)
        scaler, scale = self.loss_scaler, state.pop("loss_scale", None)
        if scale is not None and scaler is not None:
            scaler.load_state_dict(scale)
        elif scale is not None or state:
            held = sorted([*state, "loss_scale"] if scale is not None else state)
            raise UsageError(f"strategy {self.name} keeps no extra state, but the checkpoint "
                             f"holds {held}")
