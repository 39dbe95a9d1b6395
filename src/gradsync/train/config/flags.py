"""The command-line flags of TrainConfig: one flag per field, with the field's help text.

Shared by ``gradsync train`` and ``torchrun -m gradsync.train`` (see
:mod:`gradsync.train.config.train_config`).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .file import read_toml
from .train_config import TrainConfig

HIDDEN_ALIASES = {"bucket_cap_mb": ["--bucket-mb"]}

# --help's groups, in docs/train.md's order and words (its "Flags" table; issue 37: --help
# was one list of 80 flags). Every field is in one; tests/cli/test_train_help_groups.py
# reads both.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("size of the run", ("workers", "steps", "global_batch", "micro_batch", "seq_len")),
    ("model and data", ("model", "data", "data_parts", "seed", "find_unused_parameters")),
    ("optimisation", ("lr", "warmup", "schedule", "schedule_steps", "optimizer", "weight_decay",
                      "betas", "scheduler", "clip", "on_nonfinite")),
    ("how the run synchronises", (
        "strategy", "precision", "bucket_cap_mb", "backend", "collectives", "compress",
        "probe_every", "compress_delay", "sync", "sync_every", "fragments", "sync_delay",
        "sync_alpha", "outer_lr", "outer_momentum", "sync_warmup", "outer_momentum_warmup",
        "sync_every_max", "sync_eager")),
    ("slow workers", ("balance", "straggler")),
    ("run directory and recovery", (
        "out", "resume", "override", "checkpoint_every", "eval_every", "timeout",
        "max_restarts", "port", "overwrite", "trust_checkpoint_code")),
    ("observing", ("trace", "trace_steps", "drift_every", "baseline", "baseline_steps", "log",
                   "no_report")),
    ("checkpoints kept, early stopping, where a run starts", (
        "keep_last", "keep_best", "early_stop", "resume_from", "init_from")),
    ("memory and data loading", ("activation_checkpointing", "loader_workers")),
    ("fault tolerance across replica groups", ("ft_groups", "ft_group", "ft_lighthouse",
                                               "ft_timeout")),
    ("the flags in a file", ("config", "print_config")),
)


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                  given_only: bool = False) -> None:
    """One flag per TrainConfig field, with the field's help text (and ``--config``,
    ``--print-config``). ``given_only``: no defaults, so a parse holds only the flags typed
    (:func:`given_flags`)."""
    by_name = {f.name: f for f in fields(TrainConfig)}
    grouped = [n for _, names in GROUPS for n in names if n in by_name]
    if sorted(grouped) != sorted(by_name):
        raise RuntimeError(f"TrainConfig fields in no --help group (flags.GROUPS): "
                           f"{sorted(set(by_name) - set(grouped))}")
    made = {title: parser.add_argument_group(title) for title, _ in GROUPS}
    group = {n: made[title] for title, names in GROUPS for n in names}
    for f in (by_name[n] for n in grouped):
        if f.name in skip:
            continue
        into = group[f.name]
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if callable(meta.get("choices")):  # a registry, read now: later registrations count
            meta["choices"] = meta["choices"]()
        if f.type in (bool, "bool"):
            into.add_argument(flag, action="store_true", help=help_text,
                              **({"default": argparse.SUPPRESS} if given_only else {}))
            continue
        kind = (meta.pop("type", None)
                or {"int": int, "float": float, "str": str}.get(str(f.type), str))
        default = argparse.SUPPRESS if given_only else f.default
        shown = "" if f.default in ("", None) else f" (default: {f.default})"
        extra = {"nargs": "?", "const": "must"} if f.name == "resume" else {}
        into.add_argument(flag, type=kind, default=default, help=help_text + shown,
                          **meta, **extra)
        for alias in HIDDEN_ALIASES.get(f.name, ()):
            into.add_argument(alias, dest=f.name, type=kind, default=argparse.SUPPRESS,
                              help=argparse.SUPPRESS)
    group["config"].add_argument(
        "--config", metavar="FILE", default=None if not given_only else argparse.SUPPRESS,
        help="read the flags from this TOML file (keys: the flags without the dashes, e.g. "
        "global-batch = 64); flags typed on the command line win")
    group["print_config"].add_argument(
        "--print-config", action="store_true",
        **({"default": argparse.SUPPRESS} if given_only else {}),
        help="print this run's resolved flags as such a file and exit (--config of it is the "
        "same run); nothing starts")


def given_flags(argv: list[str], skip: tuple[str, ...] = ()) -> set[str]:
    """The TrainConfig fields typed on the command line ``argv`` (whatever their values)."""
    parser = argparse.ArgumentParser(add_help=False)  # abbreviations as the real parser's
    add_arguments(parser, skip, given_only=True)
    known, _ = parser.parse_known_args(argv)
    return set(vars(known))


def from_args(args: argparse.Namespace, argv: list[str] | None = None, **given) -> TrainConfig:
    """The parsed flags as a TrainConfig (checked when made); ``given``: fields the parser
    did not take (torchrun's ``workers``). With ``--config FILE`` the file's values stand
    where ``argv`` (the command line parsed, without the subcommand) typed no flag."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    if getattr(args, "config", None):
        typed = given_flags(argv or [])
        from_file = read_toml(args.config, list(fields(TrainConfig)))
        values.update({k: v for k, v in from_file.items() if k not in typed and k in values})
    return TrainConfig(**{**values, **given})
