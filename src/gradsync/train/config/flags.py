"""The command-line flags of TrainConfig: one flag per field, with the field's help text.

Shared by ``gradsync train`` and ``torchrun -m gradsync.train`` (see
:mod:`gradsync.train.config.train_config`).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .train_config import TrainConfig

HIDDEN_ALIASES = {"bucket_cap_mb": ["--bucket-mb"]}


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field, with the field's help text."""
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if callable(meta.get("choices")):  # a registry, read now: later registrations count
            meta["choices"] = meta["choices"]()
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = (meta.pop("type", None)
                or {"int": int, "float": float, "str": str}.get(str(f.type), str))
        default = f.default
        shown = "" if default in ("", None) else f" (default: {default})"
        extra = {"nargs": "?", "const": "must"} if f.name == "resume" else {}
        parser.add_argument(flag, type=kind, default=default, help=help_text + shown,
                            **meta, **extra)
        for alias in HIDDEN_ALIASES.get(f.name, ()):
            parser.add_argument(alias, dest=f.name, type=kind, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


def from_args(args: argparse.Namespace, **given) -> TrainConfig:
    """The parsed flags as a TrainConfig (checked when made); ``given``: fields the parser
    did not take (torchrun's ``workers``)."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    return TrainConfig(**{**values, **given})
