"""The update rule is part of a run's identity: continuing a run never changes it silently.

A checkpoint records its run's whole configuration. Two groups of it must match
when the run is continued. What fixes *which samples* are trained, in which order,
on which model (``state.MUST_MATCH``: model, data, global batch, seed, strategy,
...) can never change: that would be another run. What fixes *how each step
updates the weights* (:data:`IDENTITY`) may change only when asked for by name:
``--override lr,warmup`` lets those flags differ from the checkpoint's and says
what changes; any other difference is refused in one line naming the flag, its
recorded value and both ways on (the same value again, or ``--override``).

What belongs to the update rule, and why:

* ``lr``, ``warmup``, ``schedule`` and ``schedule_steps`` (the length the schedule
  was planned over, ``train/task/schedule.py``) -- together the learning rate of every
  step; a continued run keeps its plan, also when ``--steps`` grows.
* ``optimizer`` (a built-in's name, ``auto`` resolved, or the ``pkg.module:factory``
  spec), ``weight_decay``, ``betas``: the restored optimizer state only means
  something to the optimizer that wrote it, with the options it was built with.
* ``scheduler`` (``pkg.module:factory``): the user's schedule replaces the built-in.
* ``clip``: clipping rescales every step whose gradient norm exceeds it, so it is
  part of the update as much as the rate is; and its default changed (1.0 to 0, off),
  which would otherwise turn clipping off silently in a run started with the old one.

``steps`` is not identity: it says how far to train, and may grow or shrink.
Fields a checkpoint does not record (one written before the field existed) are
not compared; from the next checkpoint on they are.
"""

from __future__ import annotations

import functools

from ...errors import UsageError
from ..task.builtins import OPTIMIZERS
from ..task.schedule import past_plan_note, planned_steps

IDENTITY = ("lr", "warmup", "schedule", "schedule_steps", "optimizer", "weight_decay", "betas",
            "scheduler", "clip")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_overrides(text: str) -> frozenset[str]:
    """``--override`` as field names ("lr,schedule-steps" -> {"lr", "schedule_steps"});
    an unknown name is a UsageError listing the ones it takes."""
    names = {n.strip().lstrip("-").replace("-", "_") for n in (text or "").split(",")} - {""}
    unknown = sorted(names - set(IDENTITY))
    if unknown:
        raise UsageError(f"--override {text}: {', '.join(unknown)} is not among what it "
                         f"takes: {', '.join(n.replace('_', '-') for n in IDENTITY)} "
                         "(comma-separated); --steps, --workers and --micro-batch may change "
                         "on resume without it, the model, data, global batch, seed and "
                         "strategy never")
    return frozenset(names)


def optimizer_of(config: dict) -> str:
    opt = config.get("optimizer", "auto")
    if opt != "auto":
        return opt
    return "sgd" if config.get("model") == "mlp" else "adamw"


def _betas(value) -> tuple[float, ...] | None:
    if value in (None, ""):
        return None
    try:
        return tuple(float(v) for v in (value if isinstance(value, (list, tuple))
                                        else str(value).split(",")))
    except ValueError:
        return (value,)


@functools.cache
def _builtin_default(optimizer: str, option: str):
    """A built-in optimizer's own default for ``option`` (None: it has none), read off
    the optimizer its factory builds, so that an unset flag and the same value given
    explicitly compare equal."""
    import torch

    if optimizer not in OPTIMIZERS:
        return None
    value = OPTIMIZERS[optimizer]([torch.zeros(1, requires_grad=True)], 1.0).defaults.get(option)
    return tuple(value) if isinstance(value, (tuple, list)) else value


def _value(config: dict, name: str):
    """``name``'s value in a config, normalised for comparing (the missing sentinel when
    the config does not record it)."""
    if name == "optimizer":
        return optimizer_of(config)
    if name not in config:
        return _MISSING
    value = _betas(config[name]) if name == "betas" else config[name]
    if name in ("lr", "clip", "weight_decay") and value is not None:
        return float(value)
    return value


def _same(name: str, was, new, optimizer: str) -> bool:
    """Equal, counting an unset option and the built-in optimizer's own value for it as one
    (only then is an optimizer built to read its defaults: it costs an import of seconds)."""
    if was == new:
        return True
    if name not in ("weight_decay", "betas") or (was is not None and new is not None):
        return False
    default = _builtin_default(optimizer, name)
    return (default if was is None else was) == (default if new is None else new)


_MISSING = object()


def _shown(name: str, value) -> str:
    if value is None or value == "":
        return ("unset (the built-in schedule)" if name == "scheduler"
                else "unset (the optimizer's default)")
    if name == "betas":
        return ",".join(f"{b:g}" for b in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def planned_of(saved: dict, header: dict) -> int:
    """The schedule length a checkpoint's run was planned over (older checkpoints: its
    ``--steps``, which is what their schedule used)."""
    return int(saved.get("schedule_steps") or saved.get("steps") or header.get("steps") or 0)


def check(cfg, saved: dict, header: dict) -> tuple[int, tuple[str, ...]]:
    """Compare ``cfg`` (a resolved ``RunConfig``) with the checkpoint's ``saved`` config;
    return (the schedule length this run keeps, notes on what continuing does). Raises
    UsageError on a difference ``--override`` does not name."""
    out, step = cfg.run.out, int(header["step"])
    allowed = cfg.run.overrides  # parsed when the config was resolved
    now = {**cfg.to_dict(), "optimizer": cfg.optim.optimizer_name}
    was_planned = planned_of(saved, header)
    planned = was_planned
    notes, changed = [], set()
    for name in IDENTITY:
        was = was_planned if name == "schedule_steps" else _value(saved, name)
        new = _value(now, name)
        if name == "schedule_steps":
            if name in allowed:  # re-planned: over --schedule-steps, else the new --steps
                new = planned = planned_steps(cfg)
            elif not new:  # not given: the run's plan holds
                continue
        if was is _MISSING or _same(name, was, new, cfg.optim.optimizer_name):
            continue
        if name in ("weight_decay", "betas") and "optimizer" in changed:
            continue  # the new optimizer's options: part of the optimizer change noted
        if name not in allowed:
            hint = (f"continue it with {_flag(name)} {_shown(name, was)}"
                    if was not in (None, "") else f"continue it without {_flag(name)}")
            raise UsageError(f"{out} holds a run whose {_flag(name)} was {_shown(name, was)}, "
                             f"now {_shown(name, new)}: continuing would silently change how "
                             f"it trains; {hint}, or add --override "
                             f"{name.replace('_', '-')} to change it from step {step + 1}")
        changed.add(name)
        notes.append(f"--override {name.replace('_', '-')}: {_flag(name)} changes from "
                     f"{_shown(name, was)} to {_shown(name, new)} at step {step + 1}")
    past = past_plan_note(cfg, planned)
    if past:
        notes.append(past)
    return planned, tuple(notes)
