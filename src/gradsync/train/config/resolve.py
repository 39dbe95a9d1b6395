"""The config resolved once: :func:`resolve` turns the flags into one frozen :class:`RunConfig`.

``TrainConfig`` is the flag table, as a user writes it: one field per flag, ``auto``
and empty defaults included. Everything that follows from those flags without
knowing the number of workers or the run directory is decided here, once, and kept
in a frozen object that every later stage reads and none changes: the launcher,
each worker (it receives this object, pickled, never argv to parse again) and each
replica group of a one-machine ``--ft-groups`` run. What needs the world or the
checkpoint (the accumulation count, the resume decision, the schedule's planned
length) is :func:`gradsync.train.config.plan.plan_run`'s.

The sections and the frozen object are ``run_config.py``'s.

Every refusal of a flag or of a combination of flags lives in exactly one place,
and is made here, once: ranges, choices, what a model needs, and the rules with a
story of their own at the end of this file (flags of a mode that is off,
:func:`check_mode_flags`; what ``--ft-groups`` cannot carry yet, :func:`check_ft`;
``--data-parts``, :func:`check_data_parts`; ``--trace-steps``, :func:`traced_steps`).
Three flags are parsed by the code that reads them, called from here: ``--log``
(``records/trackers``), ``--override`` (``checkpoint/identity.py``), ``--straggler``
(``step/straggler.py``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import fields

from ...dist import BACKENDS
from ...engine.strategy.registry import FIXED_BUCKETS, PRECISIONS, STRATEGIES
from ...errors import UsageError
from ...factory import absolute_spec, is_factory_spec
from ...models import MODELS
from ..checkpoint.identity import parse_overrides
from ..records.trackers import check_log
from ..step.monitor import EarlyStop, Monitor, parse_early_stop, parse_monitor
from ..step.straggler import parse_stragglers
from ..task.builtins import DATA_FOR_MODEL, DATASETS, DEFAULT_DATA
from .run_config import (
    BALANCE_CHOICES,
    CLIP_RECIPE,
    COMPRESSORS,
    NONFINITE_CHOICES,
    OPTIMIZER_CHOICES,
    RESUME_CHOICES,
    BatchSection,
    CheckpointsSection,
    FtSection,
    ObserveSection,
    OptimSection,
    RunConfig,
    RunSection,
    SyncSection,
    TaskSection,
    flag_fields,
)


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
    for name in ("model", "data", "optimizer", "scheduler"):  # recorded as found from here
        v[name] = absolute_spec(v[name])
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
    check_ft(cfg)  # --ft-groups with what it cannot carry yet: refused, not dropped
    check_data_parts(cfg)  # --data-parts with what it cannot keep apart
    best, stop = check_checkpoints(cfg, v)  # --keep-*, --early-stop, --resume-from, --init-from
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
        checkpoints=CheckpointsSection(**{a: v[f] for f, a in flag_fields(CheckpointsSection)},
                                       best=best, stop=stop),
        task=TaskSection(**{a: v[f] for f, a in flag_fields(TaskSection)}),
        flag_order=tuple(v))


# ---------------------------------------------------------------- the rules with a story
# Each refusal below concerns flags of several sections; resolve() calls each once.

_LOCAL = ("diloco", "streaming-diloco")
OFF_VALUES = {"probe_every": 0, "compress_delay": 0}
"""Values that switch a feature off, accepted whatever the mode."""


def _rules(cfg) -> list[tuple[str, bool, str, str]]:
    """(field, its mode is on, the flag(s) that turn it on, what this run has instead)."""
    exact = cfg.sync == "exact"
    compressed = cfg.compress != "none"
    sync = f"--sync {cfg.sync}"
    both = sync + (f" --compress {cfg.compress}" if compressed else " and no --compress")
    local = "--sync diloco or --sync streaming-diloco"
    return [
        ("sync_every", cfg.sync in _LOCAL, local, sync),
        ("outer_lr", cfg.sync in _LOCAL, local, sync),
        ("outer_momentum", cfg.sync in _LOCAL, local, sync),
        ("sync_warmup", cfg.sync in _LOCAL, local, sync),
        ("outer_momentum_warmup", cfg.sync in _LOCAL, local, sync),
        ("sync_every_max", cfg.sync == "diloco", "--sync diloco", sync),
        ("sync_eager", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("fragments", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("sync_delay", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("sync_alpha", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("probe_every", exact and compressed,
         "--compress (bf16, fp16, int8, powersgd:R) with --sync exact", both),
        ("compress_delay", exact and compressed,
         "--compress (bf16, fp16, int8, powersgd:R) with --sync exact", both),
        ("balance", exact and not compressed, "--sync exact without --compress", both),
        ("baseline_steps", bool(cfg.baseline), "--baseline", "no --baseline"),
    ]


def _as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_mode_flags(cfg) -> None:
    """Raise one UsageError for the first mode flag given while its mode is off.

    Flags that only mean something in one mode: refused, naming the flag that enables them.

    ``--sync-every 10`` without ``--sync diloco`` used to be accepted and ignored, so a
    run the user believed was DiLoCo every 10 steps was exact synchronous training.
    Each flag below belongs to a mode; given while that mode is off it is refused, in
    one line, before any worker starts.

    "Given" is read from the value: a TrainConfig field is a dataclass default, and a
    flag set to its default cannot be told apart from one left out (both in the CLI and
    in ``gs.train(sync_every=25)``). So the rule is: a mode flag whose value differs
    from its default while its mode is off is refused; one equal to the default passes
    (it changes nothing either way). A value that *turns the feature off* is accepted
    in any mode (``--probe-every 0``: never probe, true of an uncompressed run too).

    Which flag belongs to which mode (decided here, documented in docs/train.md):

    * ``--sync-every``, ``--outer-lr``, ``--outer-momentum``, ``--sync-warmup``,
      ``--outer-momentum-warmup``: ``--sync diloco`` or ``streaming-diloco``;
    * ``--sync-every-max``: ``--sync diloco`` (streaming's staggered fragments assume one H);
    * ``--fragments``, ``--sync-delay``, ``--sync-alpha``, ``--sync-eager``: ``--sync
      streaming-diloco``;
    * ``--probe-every``, ``--compress-delay``: ``--compress`` with ``--sync exact`` (the probe
      sums the exact gradient beside the compressed one; DiLoCo's compressed pseudo-gradient
      has none, nor gradient buckets to delay);
    * ``--balance auto``: ``--sync exact`` without ``--compress`` (only an exact gradient
      can be split by speed and stay the same update);
    * ``--baseline-steps``: ``--baseline``.

    ``--straggler`` is not on the list: it emulates slow workers in every mode (how
    DiLoCo or a compressor copes with one is a fair question), with or without
    ``--balance``.
    """
    defaults = {f.name: f.default for f in fields(cfg)}
    for name, enabled, needs, now in _rules(cfg):
        value = getattr(cfg, name)
        if enabled or value == defaults[name] or OFF_VALUES.get(name) == value:
            continue
        raise UsageError(f"{_as_flag(name)} {value} has no effect with {now}: it needs {needs}; "
                         f"add that, or drop {_as_flag(name)}")


def check_ft(cfg) -> None:
    """Refuse flag combinations a fault-tolerant run cannot honour, naming the flag.

    What ``--ft-groups`` / ``--ft-group`` accept, checked before anything starts.

    Fault-tolerant runs carry ddp and ZeRO stages 1-3 inside a group and sum exactly
    across groups (each rank sums the slice it owns; a healing rank loads its own
    shard without a collective, since torchft heals some ranks of a group and not
    others), and ``--sync diloco`` or ``streaming-diloco`` with one DiLoCo worker per group
    (``local_groups.py``; streaming's fragment sums are taken at their sync step through the
    quorum and kept aside until applied, the plain run's trajectory without its overlap).
    What they do not carry yet is refused in one line rather than silently dropped:
    compression across the quorum (its error-feedback state is per rank, and a
    healing rank would need its peer's), the speed balancer (the quorum deals each
    step's batch) and the reference collectives.
    """
    if not isinstance(cfg.ft_groups, int) or cfg.ft_groups < 0:
        raise UsageError(f"--ft-groups must be an integer >= 0, got {cfg.ft_groups!r}")
    if cfg.ft_group != -1 and not cfg.ft_groups:
        raise UsageError("--ft-group needs --ft-groups N, the number of replica groups")
    if cfg.ft_groups and not -1 <= cfg.ft_group < cfg.ft_groups:
        raise UsageError(f"--ft-group must be in 0..{cfg.ft_groups - 1} for --ft-groups "
                         f"{cfg.ft_groups}, got {cfg.ft_group}")
    if not cfg.ft_timeout > 0:
        raise UsageError(f"--ft-timeout must be > 0, got {cfg.ft_timeout!r}")
    if not cfg.ft_groups:
        return
    refused = [(cfg.strategy not in ("ddp", "zero1", "zero2", "zero3"),
                f"--strategy {cfg.strategy}"),
               (cfg.compress != "none", f"--compress {cfg.compress}"),
               (cfg.balance != "off", f"--balance {cfg.balance}"),
               # fp16's overflow verdict is taken inside each group, before the groups' sum
               (cfg.precision == "fp16", "--precision fp16"),
               (cfg.baseline, "--baseline"),
               (cfg.collectives not in ("native", "auto"), f"--collectives {cfg.collectives}")]
    for bad, flag in refused:
        if bad:
            raise UsageError(f"{flag} does not combine with --ft-groups yet: across replica "
                             "groups gradsync sums the exact gradient of --strategy ddp or "
                             "zero1-3 (--sync exact, diloco or streaming-diloco, --precision "
                             "fp32 or bf16, --compress none, --balance off, --collectives "
                             "native or auto); see docs/fault_tolerance.md")
    for name in ("sync_warmup", "outer_momentum_warmup", "sync_every_max", "sync_eager"):
        if getattr(cfg, name):  # a group's outer syncs are due every --sync-every (local_groups.py)
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} does not combine "
                             "with --ft-groups yet: across replica groups the outer sync comes "
                             "every --sync-every steps through the quorum, from the first step")
    if cfg.ft_group == -1 and cfg.global_batch < cfg.ft_groups * cfg.workers:
        raise UsageError(f"--global-batch {cfg.global_batch} is smaller than --ft-groups "
                         f"{cfg.ft_groups} x --workers {cfg.workers}: every worker needs a sample")


def check_data_parts(cfg) -> None:
    """What ``--data-parts P`` (non-IID data, ``data/parted_sampler.py``) accepts, and what
    it refuses, before anything starts (``plan.py`` checks it against the workers).

    What ``--data-parts P`` (non-IID data, ``data/parted_sampler.py``) accepts, and what it refuses.

    Checked before anything starts, each refusal one line naming the numbers or the flag:

    * ``P`` must divide ``--global-batch`` (every part gives ``B/P`` samples a step) and the
      number of workers ``K`` (every block of ``K/P`` workers reads one part). ``K`` is known
      to ``gradsync train`` before it launches (``--workers``) and to rank 0 of a worker
      group under torchrun: ``config/plan.py`` checks it where the world is known, through
      the sampler's own check (``data/parted_sampler.check_parts``); a run resumed on another
      ``K`` is held to it too (the per-part positions are global, so any multiple of ``P``
      continues exactly).
    * ``--balance auto`` is refused: it moves samples from a slow worker to a fast one, and
      with parts a worker's samples must come from its own part; balancing inside a block
      would be possible but is not built.
    * ``--ft-groups`` is refused: the quorum deals each step's batch over whichever groups
      are alive (``ft/shares.py``), which cannot keep a part on its own block.
    * ``--straggler`` is accepted: it only slows a worker, whose share stays its own.
    * ``--sync diloco|streaming-diloco`` and ``--compress`` are accepted: the sampler only
      decides which samples a worker reads. With ``--collectives hierarchical`` and ``P`` =
      number of hosts, each DiLoCo worker (a host) trains on its own part.
    """
    parts = cfg.data_parts
    if not isinstance(parts, int) or parts < 1:
        raise UsageError(f"--data-parts must be an integer >= 1, got {parts!r}")
    if parts == 1:
        return
    if cfg.global_batch % parts:
        raise UsageError(f"--data-parts {parts} must divide --global-batch "
                         f"({cfg.global_batch}): every part gives an equal share of each step")
    for bad, flag, why in (
            (cfg.balance != "off", f"--balance {cfg.balance}",
             "balancing moves samples between workers, and with parts a worker's samples "
             "must come from its own part"),
            (cfg.ft_groups, f"--ft-groups {cfg.ft_groups}",
             "the quorum deals each step over the groups alive, which cannot keep a part "
             "on its own workers")):
        if bad:
            raise UsageError(f"{flag} does not combine with --data-parts {parts}: {why}")


def traced_steps(trace: bool, trace_steps: str, steps: int) -> tuple[int, int] | None:
    """The traced steps (1-based, inclusive), or None: ``--trace-steps`` FIRST:LAST or one
    step, within ``steps``; with ``--trace`` alone, steps 3 to 5 clipped to the run."""
    if not trace:
        return None
    if not trace_steps:
        first = min(3, steps)
        return first, min(first + 2, steps)
    text = trace_steps.strip()
    parts = text.split(":")
    try:
        if len(parts) == 1:
            first = last = int(parts[0])
        elif len(parts) == 2:
            first, last = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--trace-steps must be FIRST:LAST or one step number, "
                         f"got {trace_steps!r}") from None
    if first < 1 or last < first:
        raise UsageError(f"--trace-steps {text}: need 1 <= FIRST <= LAST")
    if last > steps:
        raise UsageError(f"--trace-steps {text} goes beyond the last step (--steps "
                         f"{steps}); choose a window within 1:{steps}")
    return first, last


# ------------------------------------------ checkpoints kept, early stopping, the start
# (issue 37: what accelerate, Lightning and torchtitan users reach for first)

_LAST_STEP_DOES_MORE = "the run's last step does more after its evaluation"


def check_checkpoints(cfg, v: dict) -> tuple[Monitor | None, EarlyStop | None]:
    """``--keep-last``, ``--keep-best``, ``--early-stop``, ``--resume-from``, ``--init-from``,
    ``--loader-workers``: ranges, what they need, what they do not combine with; the
    parsed figures. The two paths are made absolute in ``v`` (a run continued from another
    directory finds them; config.json and checkpoints record them so).

    * ``--keep-best`` and ``--early-stop`` watch held-out figures, so they need
      ``--eval-every`` > 0; a metric the data lacks is refused when the task is built
      (``step/monitor.check_watched``: a factory's metrics exist only once it has run).
      When both watch the same figure they must agree which way is better.
    * ``--early-stop`` does not combine with ``--sync diloco|streaming-diloco`` nor with
      ``--compress-delay 1``: there the last step syncs the replicas, or applies the
      gradient still in flight, *after* its evaluation, so stopping on an evaluation
      would end on another model than the one evaluated.
    * None of them combines with ``--ft-groups`` yet (each replica group saves its own
      checkpoints; kept units and a stop decided across groups are not built).
    * ``--resume-from`` continues a checkpoint, ``--init-from`` starts afresh from
      weights: one or the other.
    """
    for name in ("keep_last", "loader_workers"):
        if not isinstance(v[name], int) or isinstance(v[name], bool) or v[name] < 0:
            raise UsageError(f"{_as_flag(name)} must be an integer >= 0, got {v[name]!r}")
    best = parse_monitor(v["keep_best"], "--keep-best")
    stop = parse_early_stop(v["early_stop"])
    for flag, watched in (("--keep-best", best), ("--early-stop", stop)):
        if watched is not None and not v["eval_every"]:
            raise UsageError(f"{flag} watches held-out evaluations, and --eval-every is 0: "
                             f"give --eval-every N (the steps between evaluations)")
    if best and stop and best.name == stop.monitor.name and best.mode != stop.monitor.mode:
        raise UsageError(f"--keep-best {best.spec} and --early-stop {stop.monitor.spec} watch "
                         f"{best.name} in opposite directions: give both :min or both :max")
    if stop is not None:
        for bad, flag in ((v["sync"] != "exact", f"--sync {v['sync']}"),
                          (v["compress_delay"], f"--compress-delay {v['compress_delay']}")):
            if bad:
                raise UsageError(f"--early-stop does not combine with {flag}: "
                                 f"{_LAST_STEP_DOES_MORE} (the final sync or the pending "
                                 "gradient), so it would not end on the model it evaluated")
    if v["ft_groups"]:
        for name in ("keep_last", "keep_best", "early_stop", "resume_from"):
            if v[name]:
                raise UsageError(f"{_as_flag(name)} does not combine with --ft-groups yet: "
                                 "each replica group keeps its own checkpoint")
    if v["resume_from"] and v["init_from"]:
        raise UsageError("--resume-from continues a checkpoint and --init-from starts a new run "
                         "from weights: give one of them")
    for name in ("resume_from", "init_from"):
        if v[name]:
            v[name] = os.path.abspath(os.path.expanduser(str(v[name])))
    return best, stop
