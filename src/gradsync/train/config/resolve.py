"""The config resolved once: :func:`resolve` turns the flags into one frozen :class:`RunConfig`.

``TrainConfig`` is the flag table, as a user writes it: one field per flag, ``auto``
and empty defaults included. Everything that follows from those flags without
knowing the number of workers or the run directory is decided here, once, and kept
in a frozen object that every later stage reads and none changes: the launcher,
each worker (it receives this object, pickled, never argv to parse again) and each
replica group of a one-machine ``--ft-groups`` run. What needs the world or the
checkpoint (the accumulation count, the resume decision, the schedule's planned
length) is :func:`gradsync.train.config.plan.plan_run`'s.

Six sections, each a frozen dataclass, so a reader finds a value where its idea is:

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

Every refusal of a flag or of a combination of flags lives in exactly one place,
and is made here: this module's own (ranges, choices, what a model needs) and the
rules that have a file of their own (``mode_flags.py``: flags of a mode that is off;
``parts_flags.py``: ``--data-parts``; ``trace_flags.py``: ``--trace-steps``;
``ft/flags.py``: ``--ft-groups``; ``records/trackers``: ``--log``;
``checkpoint/identity.py``: ``--override``; ``step/straggler.py``: ``--straggler``).
:meth:`RunConfig.to_dict` gives the flags back, flat, as config.json and checkpoints
record them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, fields

from ...dist import BACKENDS
from ...engine.strategy.options import SyncOptions
from ...engine.strategy.registry import FIXED_BUCKETS, PRECISIONS, STRATEGIES
from ...errors import UsageError
from ...factory import is_factory_spec
from ...ft.flags import check_ft
from ...models import MODELS
from ..checkpoint.identity import parse_overrides
from ..records.trackers import check_log
from ..step.straggler import Straggler, parse_stragglers
from ..task.builtins import DATA_FOR_MODEL, DATASETS, DEFAULT_DATA, OPTIMIZERS
from .mode_flags import check_mode_flags
from .parts_flags import check_data_parts
from .trace_flags import traced_steps

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


SECTIONS = {"run": RunSection, "batch": BatchSection, "optim": OptimSection,
            "sync": SyncSection, "ft": FtSection, "observe": ObserveSection}


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


def _check_name(value: str, known, what: str, hint: str, empty_ok: bool = False) -> None:
    if value in known or is_factory_spec(value) or (empty_ok and value == ""):
        return
    raise argparse.ArgumentTypeError(f"unknown {what} {value!r}: choose from "
                                     f"{', '.join(known)}, or pass {hint}")


def check_model(value: str) -> str:
    _check_name(value, MODELS, "model", "pkg.module:factory")
    return value


def check_data(value: str) -> str:
    _check_name(value, DATASETS, "data", "pkg.module:factory", empty_ok=True)
    return value


def check_optimizer(value: str) -> str:
    _check_name(value, OPTIMIZER_CHOICES, "optimizer",
                "pkg.module:factory (a function of the parameter groups returning an optimizer)")
    return value


def bucket_cap(value: str):
    return value if value == "auto" else float(value)


def _betas(text: str) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        pair = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(0 <= b < 1 for b in pair):
        raise UsageError(f"--betas takes B1,B2, each in [0, 1), got {text!r}")
    return pair


def _optimizer_name(optimizer: str, model: str) -> str:
    """The built-in optimizer ``auto`` stands for (sgd for the mlp, adamw otherwise), or
    the user's factory as ``pkg.module:factory``: what checkpoints record."""
    if optimizer != "auto":
        return optimizer
    return "sgd" if model == "mlp" else "adamw"


def _resume(value) -> str:
    if value is True or value is None:  # from Python: resume=True
        return "must"
    return "auto" if value is False else value


def resolve(cfg) -> RunConfig:
    """Check every flag of ``cfg`` (a :class:`TrainConfig`) once; the frozen result.

    Raises one :class:`UsageError` for the first problem, naming the flag and the way on.
    """
    v = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    for name in ("workers", "steps", "global_batch", "micro_batch", "seq_len"):
        if not isinstance(v[name], int) or v[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, "
                             f"got {v[name]!r}")
    cap = v["bucket_cap_mb"]
    if cap != "auto" and not (isinstance(cap, (int, float)) and cap > 0):
        raise UsageError(f"--bucket-cap-mb must be > 0 or 'auto', got {cap!r}")
    for name in ("lr", "timeout"):
        if not v[name] > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {v[name]!r}")
    if v["clip"] is None:  # the model's recipe: see the field's help and CLIP_RECIPE
        v["clip"] = CLIP_RECIPE.get(v["model"], 0.0)
    if v["warmup"] < 0 or v["checkpoint_every"] < 0 or v["clip"] < 0:
        raise UsageError("--warmup, --checkpoint-every and --clip must be >= 0")
    if not isinstance(v["schedule_steps"], int) or v["schedule_steps"] < 0:
        raise UsageError(f"--schedule-steps must be an integer >= 0, got {v['schedule_steps']!r}")
    overrides = parse_overrides(v["override"])  # names only what may be overridden
    if v["eval_every"] < 0 or v["max_restarts"] < 0:
        raise UsageError("--eval-every and --max-restarts must be >= 0")
    if not 0 <= v["port"] <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {v['port']}")
    v["resume"] = _resume(v["resume"])
    for name, choices in (("backend", BACKENDS), ("strategy", tuple(STRATEGIES)),
                          ("precision", PRECISIONS),
                          ("resume", RESUME_CHOICES), ("on_nonfinite", NONFINITE_CHOICES),
                          ("balance", BALANCE_CHOICES)):
        if v[name] not in choices:
            raise UsageError(f"unknown {name.replace('_', '-')} {v[name]!r}; "
                             f"choose from {', '.join(choices)}")
    try:
        check_model(v["model"])
        check_data(v["data"])
        check_optimizer(v["optimizer"])
    except argparse.ArgumentTypeError as e:
        raise UsageError(str(e)) from None
    wd = v["weight_decay"]
    if wd is not None and not (isinstance(wd, (int, float)) and wd >= 0):
        raise UsageError(f"--weight-decay must be a number >= 0, got {wd!r}")
    optimizer_name = _optimizer_name(v["optimizer"], v["model"])
    betas = _betas(v["betas"])
    if betas and optimizer_name == "sgd":
        raise UsageError(f"--betas is an Adam option; the optimizer is sgd (--optimizer "
                         f"{v['optimizer']}), which has none")
    if v["scheduler"] and not is_factory_spec(v["scheduler"]):
        raise UsageError(f"--scheduler takes pkg.module:factory, got {v['scheduler']!r}")
    if cap == "auto" and v["strategy"] in FIXED_BUCKETS:
        raise UsageError(f"--bucket-cap-mb auto needs --strategy ddp: {v['strategy']} "
                         "shards along a fixed bucket layout")
    if not v["data"]:
        if v["model"] not in DEFAULT_DATA:
            raise UsageError(f"--model {v['model']} needs --data: a built-in dataset "
                             f"({', '.join(DATASETS)}) or pkg.module:factory")
        v["data"] = DEFAULT_DATA[v["model"]]
    model, data = v["model"], v["data"]
    if model in DATA_FOR_MODEL and data in DATASETS and data not in DATA_FOR_MODEL[model]:
        raise UsageError(f"--data {data} does not fit --model {model}; "
                         f"use one of {', '.join(DATA_FOR_MODEL[model])}")
    if not v["out"]:
        v["out"] = time.strftime("runs/%Y%m%d-%H%M%S")
    if v["compress"].split(":")[0] not in COMPRESSORS:
        raise UsageError(f"unknown --compress {v['compress']!r}; choose none, bf16, fp16, "
                         "powersgd:R or int8")
    sync = SyncSection(**{a: v[f] for f, a in flag_fields(SyncSection)})
    sync.options.check_precision(v["precision"])  # the engine's own check, before any worker
    if v["drift_every"] < 0 or v["baseline_steps"] < 1:
        raise UsageError("--drift-every must be >= 0 and --baseline-steps >= 1")
    if v["trace_steps"]:
        v["trace"] = True
    window = traced_steps(v["trace"], v["trace_steps"], v["steps"])
    stragglers = tuple(parse_stragglers(v["straggler"]))
    v["log"] = check_log(v["log"])  # unknown trackers, missing packages: refused now
    check_mode_flags(cfg)  # --sync-every without --sync diloco: refused, not ignored
    check_ft(cfg)  # --ft-groups with what it cannot carry yet: refused (ft/flags.py)
    check_data_parts(cfg)  # --data-parts with what it cannot keep apart (parts_flags.py)
    balanced = v["balance"] == "auto" and v["sync"] == "exact" and v["compress"] == "none"
    return RunConfig(
        run=RunSection(**{a: v[f] for f, a in flag_fields(RunSection)}, overrides=overrides),
        batch=BatchSection(**{a: v[f] for f, a in flag_fields(BatchSection)},
                           balanced=balanced, stragglers=stragglers),
        optim=OptimSection(**{a: v[f] for f, a in flag_fields(OptimSection)},
                           optimizer_name=optimizer_name, betas_pair=betas),
        sync=sync,
        ft=FtSection(**{a: v[f] for f, a in flag_fields(FtSection)}),
        observe=ObserveSection(**{a: v[f] for f, a in flag_fields(ObserveSection)},
                               trace_window=window),
        flag_order=tuple(v))
