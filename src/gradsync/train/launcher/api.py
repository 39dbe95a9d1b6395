"""``gradsync.train()``: the `gradsync train` loop from Python, with your own model and data.

    import gradsync as gs
    summary = gs.train(gs.TrainConfig(steps=200, out="runs/a", workers=2),
                       model=my_pkg.build_model, data=my_pkg.build_data)

Checkpoints, elastic resume (also on another number of workers), exact
accumulation, metrics, NaN guards and the report come with it. Called in a
plain process it checks the run directory, takes its lock and launches
``config.workers`` local workers; called where a process group already exists
(a script under ``torchrun``, or inside ``gradsync.spawn``) it runs this rank's
part. ``model``/``data`` are factories (contracts in ``train/task/build.py``): to reach
launched workers they must be importable by name (module-level functions), or
be given as ``"pkg.module:factory"`` strings.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import sys
from collections.abc import Callable

import torch.distributed as dist

from ... import dist as gdist
from ...errors import UsageError, WorkerFailedError
from ...factory import check_factory, factory_name, is_factory_spec
from ..checkpoint.restarts import record_pending
from ..config.run_config import RunConfig
from ..config.train_config import TrainConfig
from ..records.callbacks import check_callbacks
from ..records.summary import repair_summary
from ..task.schedule import finished_line
from ..worker.faults import FaultInjector
from ..worker.loop import run_worker
from .preflight import preflight

ONE_LINE_ERRORS = ("UsageError", "CheckpointCorrupt", "CheckpointError", "UnsafeFileError")
"""Worker errors that are the user's to fix: the launcher says them in one line, exit 2."""


FLIGHT_ENV = "GRADSYNC_FLIGHT_DIR"


def launch_workers(cfg: RunConfig, model_fn=None, data_fn=None,
                   faults: FaultInjector | None = None, factories: dict | None = None,
                   callbacks: list | None = None) -> dict | None:
    """Start ``cfg.run.workers`` local workers on a prepared run directory; rank 0's summary."""
    from ...launch import launch  # torch's elastic launcher, only when a run launches

    # a collective that fails leaves each rank's flight record in the run directory,
    # where the launcher's hang report (and the user) find it; an explicit setting wins
    flight = os.environ.get(FLIGHT_ENV) or os.path.join(os.path.abspath(cfg.run.out), "flight")
    saved = os.environ.get(FLIGHT_ENV)
    os.environ[FLIGHT_ENV] = flight
    try:
        run = cfg.run
        results = launch(run_worker, run.workers,  # the resolved config itself, pickled
                         (cfg, model_fn, data_fn, faults, True, factories, callbacks),
                         backend=run.backend, timeout_s=run.timeout,
                         rdzv_endpoint=f"localhost:{run.port}", max_restarts=run.max_restarts,
                         on_restart=record_pending(run.out, run.max_restarts))
    finally:
        if saved is None:
            os.environ.pop(FLIGHT_ENV, None)
    return results.get(0)


def usage_error_of(err: WorkerFailedError) -> UsageError | None:
    """The one-line UsageError a worker failure stands for, if it is one."""
    first = next((ln for ln in str(err).splitlines() if ln.startswith("worker rank ")), "")
    m = re.match(r"worker rank \d+ failed: (\w+): (.*)", first)
    if m and m.group(1) in ONE_LINE_ERRORS:
        return UsageError(m.group(2))
    return None


def take_factories(overrides: dict) -> dict[str, Callable]:
    """``optimizer=``/``scheduler=`` given to ``gs.train`` as functions: each becomes its
    ``module:qualname`` in ``overrides`` (the config's record) and an entry of the
    returned {name: function}, which travels to the workers pickled, like ``model=`` and
    ``data=``: there it is what that name loads (``task/optim.optimizer_factory``), so a
    function of the caller's own script works although its ``__main__`` cannot be
    imported by name."""
    factories = {}
    for key in ("optimizer", "scheduler"):
        fn = overrides.get(key)
        if fn is None or isinstance(fn, str):
            continue
        qualname = getattr(fn, "__qualname__", "")
        if not callable(fn) or not qualname or "<lambda>" in qualname or "<locals>" in qualname:
            raise UsageError(f"{key}= takes a module-level function or 'pkg.module:factory' "
                             f"(a lambda, a nested function or an instance cannot reach the "
                             f"workers), got {fn!r}")
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise UsageError(f"{key}= {qualname} cannot reach the workers ({e})") from None
        name = factory_name(fn)
        overrides[key], factories[name] = name, fn
    return factories


def _config(config, model, data, overrides: dict) -> tuple[TrainConfig, object, object]:
    """The flags ``gs.train`` was given, as one TrainConfig, and the factory objects."""
    if isinstance(config, (str, os.PathLike)):  # a --config file (config/file.py)
        config = TrainConfig.from_file(config, **overrides)
    elif config is None:
        config = TrainConfig(**overrides) if overrides else TrainConfig()
    elif isinstance(config, dict):
        config = TrainConfig(**{**config, **overrides})
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    model_fn = data_fn = None
    changes = {}
    for what, given in (("model", model), ("data", data)):
        if given is not None and not isinstance(given, str):
            check_factory(given, what)
    if model is not None:
        if isinstance(model, str) and not is_factory_spec(model):
            changes["model"] = model
        else:
            changes["model"], model_fn = factory_name(model), None if isinstance(model, str) \
                else model
    if data is not None:
        if isinstance(data, str) and not is_factory_spec(data):
            changes["data"] = data
        else:
            changes["data"], data_fn = factory_name(data), None if isinstance(data, str) else data
    if changes:
        config = dataclasses.replace(config, **changes)
    return config, model_fn, data_fn


def train(config: TrainConfig | dict | None = None, model=None, data=None, *,
          faults: FaultInjector | None = None, callbacks=None, **overrides) -> dict | None:
    """Train like ``gradsync train``; returns the run summary (rank 0 / the launcher).

    Args:
        config: a :class:`TrainConfig`, a dict of its fields, or the path of a TOML file
            of them (``gradsync train --config``'s; ``TrainConfig.from_file``);
            ``overrides`` replace fields (``steps=100, out="runs/a"``).
        model: a factory ``() -> nn.Module`` or ``"pkg.module:factory"`` (or a
            built-in name); default ``config.model``.
        data: a factory ``() -> Dataset | TrainData`` or ``"pkg.module:factory"``;
            default ``config.data``.
        faults: a :class:`FaultInjector` (tests of recovery).
        callbacks: objects with ``on_step_end``/``on_eval``/``on_checkpoint`` (e.g.
            :class:`gradsync.Callback` subclasses), called on rank 0 (``records/callbacks.py``).
        ``optimizer=``/``scheduler=`` (overrides) may be module-level functions, the
        factories of ``train/task/optim.py``; they reach the workers pickled
        (:func:`take_factories`).
    Returns None when the run directory held a finished run (nothing is done),
    on ranks other than 0, or after an injected stop.
    """
    caller = sys._getframe(1)
    if caller.f_code.co_name == "<module>" and caller.f_globals.get("__name__") == "__mp_main__":
        # a worker re-importing the caller's script (forkserver/spawn) reached this call
        raise UsageError("gs.train() was called again inside a worker, from the script's "
                         "top level: call it under `if __name__ == \"__main__\":`")
    factories = take_factories(overrides)
    callbacks = check_callbacks(callbacks)
    given, model_fn, data_fn = _config(config, model, data, overrides)
    if dist.is_initialized() and given.workers != gdist.world_size():
        given = dataclasses.replace(given, workers=gdist.world_size())  # the group's own
    cfg = given.resolved()
    if dist.is_initialized():  # this process is one rank of a group: its part of the run
        return run_worker(cfg, model_fn, data_fn, faults, False, factories, callbacks)
    plan, lock = preflight(cfg, model_fn)
    try:
        if lock.note():
            print(f"gradsync train: {lock.note()}", flush=True)
        if plan.action == "finished":
            print(finished_line(cfg, plan.step, plan.schedule_steps, plan.notes), flush=True)
            repair_summary(cfg.run.out)
            return None
        try:
            return launch_workers(cfg, model_fn, data_fn, faults, factories, callbacks)
        except WorkerFailedError as e:
            usage = usage_error_of(e)
            if usage is not None:
                raise usage from None
            raise
    finally:
        lock.release()
