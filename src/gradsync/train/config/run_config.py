"""What a resolved run is: :class:`RunConfig`, eight frozen sections of checked flags.

``TrainConfig`` is the flag table, as a user writes it;
:func:`~gradsync.train.config.resolve.resolve` checks it and returns the object
defined here, which every later stage reads and none changes: the launcher, each
worker (it receives this object, pickled, never argv to parse again) and each
replica group of a one-machine ``--ft-groups`` run.
Kept apart from ``resolve.py`` because the two are read for different reasons: here
what a run holds and where a value lives, there how flags become it and what is
refused.

Eight sections, each a frozen dataclass, so a reader finds a value where its idea is:

* ``run``: what is trained, where, how long -- model, data, steps, the run directory,
  resuming, the workers and their backend;
* ``batch``: the global batch and how it is dealt -- micro-batch, data parts, the
  speed balancer, emulated stragglers;
* ``optim``: the update rule -- learning rate and schedule, optimizer and its options,
  clipping, what a NaN does;
* ``sync``: how replicas agree -- strategy, precision, buckets, and the synchronisation
  method with its options (``--sync``, ``--compress``, ``--collectives``, ...);
* ``ft``: fault tolerance across replica groups;
* ``observe``: what the run records -- evaluation, trace, drift check, trackers, the
  report, the baseline.
* ``checkpoints``: which checkpoints are kept (the last N, the best), early stopping,
  and the checkpoint a run continues from (``--resume-from``);
* ``task``: how the model and its data are made ready -- the weights it starts from
  (``--init-from``), activation checkpointing, the data loader's workers.

:meth:`RunConfig.to_dict` gives the flags back, flat, as config.json and checkpoints
record them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ...engine.strategy.options import SyncOptions
from ..step.monitor import EarlyStop, Monitor
from ..step.straggler import Straggler
from ..task.builtins import OPTIMIZERS

OPTIMIZER_CHOICES = ("auto", *OPTIMIZERS)
RESUME_CHOICES = ("auto", "must", "never")
SCHEDULES = ("cosine", "constant")
NONFINITE_CHOICES = ("stop", "skip-step")
BALANCE_CHOICES = ("off", "auto")
COMPRESSORS = ("none", "bf16", "fp16", "powersgd", "int8")
CLIP_RECIPE = {"gpt": 1.0}
"""--clip when not given, per built-in model: the built-in GPT's recipe clips at 1.0
(without it the Quickstart's 300 steps ended at a held-out loss of 2.15, with it
1.74: one seed each); every other model gets torch DDP's behaviour, no clipping."""


def _derived(**kw):
    """A section field that no flag gives: computed by :func:`resolve`."""
    return field(metadata={"derived": True}, **kw)


def _flag(name: str, **kw):
    """A section field named apart from its flag (``--sync-every`` is ``sync.every``)."""
    return field(metadata={"flag": name}, **kw)


@dataclass(frozen=True)
class RunSection:
    """What is trained, where, for how long, on which workers."""

    model: str
    data: str  # resolved: a model's default dataset when --data was not given
    seq_len: int
    steps: int
    seed: int
    out: str  # resolved: runs/<date-time> when --out was not given
    resume: str  # resolved: "auto", "must" or "never" (True/False from Python mapped)
    overwrite: bool
    trust_checkpoint_code: bool
    override: str
    checkpoint_every: int
    workers: int
    backend: str
    timeout: float
    max_restarts: int
    port: int
    overrides: frozenset = _derived(default=frozenset())  # --override's field names


@dataclass(frozen=True)
class BatchSection:
    """The global batch and how each step's is dealt over the workers."""

    global_batch: int
    micro_batch: int
    data_parts: int
    balance: str
    straggler: str
    balanced: bool = _derived(default=False)  # split by measured speed (exact sync only)
    stragglers: tuple[Straggler, ...] = _derived(default=())  # --straggler, parsed


@dataclass(frozen=True)
class OptimSection:
    """The update rule: learning rate and schedule, optimizer, clipping, NaN policy."""

    lr: float
    warmup: int
    schedule: str
    schedule_steps: int  # as given (0: the run's --steps at its first launch; plan_run's)
    optimizer: str  # as given ("auto" included): what --override compares by name
    weight_decay: float | None
    betas: str
    scheduler: str
    clip: float  # resolved: the model's recipe when --clip was not given
    on_nonfinite: str
    optimizer_name: str = _derived(default="")  # auto resolved: adamw, sgd, or pkg.module:fn
    betas_pair: tuple[float, float] | None = _derived(default=None)


@dataclass(frozen=True)
class SyncSection:
    """How replicas agree: the strategy, precision, buckets and the sync method."""

    strategy: str
    precision: str
    bucket_cap_mb: float | str
    find_unused_parameters: bool
    method: str = _flag("sync")
    every: int = _flag("sync_every")
    fragments: int = _flag("fragments")
    delay: int = _flag("sync_delay")
    alpha: float = _flag("sync_alpha")
    outer_lr: float = _flag("outer_lr")
    outer_momentum: float = _flag("outer_momentum")
    warmup: int = _flag("sync_warmup")
    momentum_warmup: int = _flag("outer_momentum_warmup")
    every_max: int = _flag("sync_every_max")
    eager: bool = _flag("sync_eager")
    compress: str = _flag("compress")
    collectives: str = _flag("collectives")
    probe_every: int = _flag("probe_every")
    compress_delay: int = _flag("compress_delay")

    @property
    def options(self) -> SyncOptions:
        """The engine's :class:`SyncOptions` for these flags."""
        names = {f.name for f in fields(SyncOptions)}
        return SyncOptions(**{f.name: getattr(self, f.name) for f in fields(self)
                              if f.name in names})


@dataclass(frozen=True)
class FtSection:
    """Fault tolerance across replica groups (``docs/fault_tolerance.md``)."""

    groups: int = _flag("ft_groups")
    group: int = _flag("ft_group")
    lighthouse: str = _flag("ft_lighthouse")
    timeout: float = _flag("ft_timeout")

    @property
    def member(self) -> bool:
        """This job is one replica group (``--ft-group``): its steps go through a quorum."""
        return self.group >= 0

    @property
    def launcher(self) -> bool:
        """``--ft-groups N`` alone: start a lighthouse and N groups on this machine."""
        return bool(self.groups) and self.group < 0


@dataclass(frozen=True)
class ObserveSection:
    """What the run records besides its steps: evaluation, trace, drift, trackers."""

    eval_every: int
    trace: bool  # resolved: --trace-steps implies --trace
    trace_steps: str
    drift_every: int
    log: str  # resolved: normalised, "tensorboard,csv"
    no_report: bool
    baseline: bool
    baseline_steps: int
    trace_window: tuple[int, int] | None = _derived(default=None)  # 1-based, inclusive


@dataclass(frozen=True)
class CheckpointsSection:
    """Checkpoints kept beside the newest, early stopping, the checkpoint a run starts from."""

    keep_last: int
    keep_best: str
    early_stop: str
    resume_from: str  # resolved: absolute
    best: Monitor | None = _derived(default=None)  # --keep-best, parsed
    stop: EarlyStop | None = _derived(default=None)  # --early-stop, parsed

    @property
    def watched(self) -> list[tuple[str, Monitor]]:
        """(flag, figure) of every held-out figure the run watches."""
        return ([("--keep-best", self.best)] if self.best else []) + \
            ([("--early-stop", self.stop.monitor)] if self.stop else [])


@dataclass(frozen=True)
class TaskSection:
    """How the model and its data are made ready: starting weights, recomputation, loading."""

    init_from: str  # resolved: absolute
    activation_checkpointing: bool
    loader_workers: int


SECTIONS = {"run": RunSection, "batch": BatchSection, "optim": OptimSection,
            "sync": SyncSection, "ft": FtSection, "observe": ObserveSection,
            "checkpoints": CheckpointsSection, "task": TaskSection}


def flag_fields(section) -> list[tuple[str, str]]:
    """(flag's field name in TrainConfig, the section's field name) of a section class."""
    return [(f.metadata.get("flag", f.name), f.name) for f in fields(section)
            if not f.metadata.get("derived")]


@dataclass(frozen=True)
class RunConfig:
    """Every flag of a run, checked, with every value that follows from them alone.

    Frozen and picklable: the launcher hands it to the workers and to replica groups as
    it is. Built only by :func:`resolve`.
    """

    run: RunSection
    batch: BatchSection
    optim: OptimSection
    sync: SyncSection
    ft: FtSection
    observe: ObserveSection
    checkpoints: CheckpointsSection
    task: TaskSection
    flag_order: tuple[str, ...] = ()  # the flag table's order, which to_dict keeps

    def to_dict(self) -> dict:
        """The flags as ``TrainConfig`` names them, flat, in its order (what config.json
        and checkpoints record)."""
        out = {}
        for name in SECTIONS:
            section = getattr(self, name)
            for flag, attr in flag_fields(type(section)):
                out[flag] = getattr(section, attr)
        return {k: out[k] for k in sorted(out, key=self._position)}

    def _position(self, flag: str) -> int:
        return self.flag_order.index(flag) if flag in self.flag_order else len(self.flag_order)

    def record(self, schedule_steps: int) -> dict:
        """What config.json and a checkpoint record: the flags, ``auto`` resolved and the
        schedule's planned length the run keeps (``plan.RunPlan.schedule_steps``)."""
        return {**self.to_dict(), "optimizer": self.optim.optimizer_name,
                "schedule_steps": schedule_steps}
