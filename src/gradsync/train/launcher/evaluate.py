"""``gradsync eval RUN`` and ``gs.evaluate(RUN)``: a checkpoint scored on the held-out set.

What a Lightning user calls ``trainer.validate(ckpt_path=...)`` and a transformers user
``trainer.evaluate()``: the exact held-out loss (and ``TrainData.metrics``) of a
checkpoint -- a run's newest, a kept one (``RUN/checkpoints/best``, ``.../step-N``) -- on
the workers of the run, by the training loop's own evaluation (``worker/evaluate.py``).

The decisions:

* **Exact, and bitwise on the run's workers.** On as many workers as wrote the checkpoint
  (the default), each rank takes the held-out samples it took in the run, a training step's
  share at a time, and the sums meet in one all-reduce in the same order: the loss is the
  run's ``eval_loss`` at that step to the last bit, and ``gradsync eval`` says whether it
  matched the value the run recorded. On another number of workers (``--workers``) it is
  the same exact mean summed in another order: equal to float rounding (about 1e-16
  relative in float64), and said so.
* **Nothing of the run is changed.** The run directory is read, never written (no lock,
  no metrics, no config): an evaluation may run beside the training that writes it, on a
  checkpoint the training has finished writing (a save is atomic; a kept unit is whole or
  absent).
* **Code only from the command line.** The checkpoint is verified and read as data only
  (``checkpoint/unit.py``); a model or data factory the run recorded is imported only when
  the command line names it (``--model``, ``--data``), as ``gradsync export`` does; the
  run's optimizer is never built (``worker/evaluate.py``). ``--data`` may also name other
  data: its held-out set is scored instead.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields

import torch.distributed as dist

from ... import dist as gdist
from ...errors import UsageError, WorkerFailedError
from ...factory import check_factory, factory_name
from ...rundir import CHECKPOINT, KEPT, METRICS, read_metrics
from ...safeload import trusting
from ..checkpoint.export import model_spec
from ..checkpoint.kept import resolve_ref
from ..checkpoint.unit import read_unit
from ..config.train_config import TrainConfig
from ..task.builtins import DATASETS
from ..worker.evaluate import run_eval
from .api import usage_error_of

COMMAND = "gradsync eval"
NEUTRAL = dict(optimizer="adamw", betas="", weight_decay=None, scheduler="", override="",
               log="", trace=False, trace_steps="", baseline=False, no_report=True,
               drift_every=0, eval_every=1, checkpoint_every=0, max_restarts=0, resume="auto",
               keep_last=0, keep_best="", early_stop="", resume_from="", init_from="",
               straggler="", balance="off", ft_groups=0, ft_group=-1, ft_lighthouse="",
               overwrite=False, loader_workers=0)
"""Flags of the recorded run that an evaluation does not act on: what it writes, how it
trains and steps (a stand-in optimizer that never steps), how it is launched."""


@dataclass
class Evaluated:
    """What ``gradsync eval`` found (``gs.evaluate``'s result)."""

    checkpoint: str  # the checkpoint.pt scored
    step: int
    workers: int
    was_workers: int | None  # the workers that wrote the checkpoint
    eval_loss: float | None
    eval_metrics: dict
    held_out: int  # held-out samples
    data: str
    recorded: float | None  # the run's own eval_loss at that step (its metrics.jsonl)

    @property
    def matches(self) -> bool | None:
        """Whether the score equals the run's own, bit for bit (None: none recorded)."""
        if self.recorded is None or self.eval_loss is None:
            return None
        return self.eval_loss == self.recorded


def _recorded_eval(unit: str, step: int) -> float | None:
    """The run's eval_loss at ``step`` from its metrics.jsonl (the run directory of a kept
    unit is two levels up)."""
    parent = os.path.dirname(os.path.normpath(unit))
    run = os.path.dirname(parent) if os.path.basename(parent) == KEPT else unit
    rows, _ = read_metrics(os.path.join(run, METRICS))
    values = [r.get("eval_loss") for r in rows if r.get("step") == step and "eval_loss" in r]
    return values[-1] if values and isinstance(values[-1], float) else None


def _config(recorded: dict, model: str, data: str, workers: int, where: str,
            **launch) -> TrainConfig:
    known = {f.name for f in fields(TrainConfig)}
    flags = {k: v for k, v in recorded.items() if k in known}
    try:
        return TrainConfig(**{**flags, **NEUTRAL, "model": model, "data": data,
                              "workers": workers, "out": where, **launch})
    except UsageError as e:
        raise UsageError(f"the run's recorded flags cannot be evaluated here: {e}") from None


def evaluate(run: str, *, model=None, data=None, workers: int | None = None,
             trust_checkpoint_code: bool = False, timeout: float = 300.0, port: int = 0,
             backend: str = "auto") -> Evaluated:
    """Score the checkpoint ``run`` names (a run directory, ``RUN/checkpoints/best`` or
    ``.../step-N``) on its held-out set, on ``workers`` workers (default: the run's).

    ``model``/``data``: a factory or ``"pkg.module:factory"`` (needed when the run was
    trained with one: a factory the run records is never imported on its word); ``data``
    may name other data, whose held-out set is then scored. Inside a process group (a
    script under torchrun) this rank's part is run, on the group's workers.
    """
    unit = resolve_ref(run, COMMAND)
    path = os.path.join(unit, CHECKPOINT)
    with trusting(trust_checkpoint_code):
        header = read_unit(path)  # every byte of the unit, data only
    recorded = header.get("config") or {}
    model_fn = data_fn = None
    for what, given in (("model", model), ("data", data)):
        if given is not None and not isinstance(given, str):
            check_factory(given, what)
    if model is not None and not isinstance(model, str):
        model_fn, model = model, factory_name(model)
    if data is not None and not isinstance(data, str):
        data_fn, data = data, factory_name(data)
    spec = model_spec(model, recorded, unit, COMMAND)
    dspec = model_spec(data, recorded, unit, COMMAND, flag="data", builtins=DATASETS)
    if dist.is_initialized():
        workers = gdist.world_size()
    was = header.get("world_size")
    workers = workers or (was if isinstance(was, int) and was > 0 else 2)
    cfg = _config(recorded, spec, dspec, workers, unit, timeout=timeout, port=port,
                  backend=backend).resolved()
    args = (cfg, unit, model_fn, data_fn, trust_checkpoint_code)
    if dist.is_initialized():
        out = run_eval(*args)
    else:
        from ...launch import launch

        gdist.check_local_devices(gdist.resolve_backend(backend), workers)
        try:
            out = launch(run_eval, workers, args, backend=backend, timeout_s=timeout,
                         rdzv_endpoint=f"localhost:{port}").get(0)
        except WorkerFailedError as e:
            usage = usage_error_of(e)
            if usage is not None:
                raise usage from None
            raise
    if out is None:  # a rank other than 0 of a group
        return None
    recorded_loss = _recorded_eval(unit, int(header["step"])) if dspec == recorded.get("data") \
        else None
    return Evaluated(path, int(header["step"]), workers, was, out["eval_loss"],
                     out["eval_metrics"] or {}, out["held_out"], dspec, recorded_loss)


def describe(r: Evaluated) -> list[str]:
    """``gradsync eval``'s lines."""
    loss = "none (no held-out items)" if r.eval_loss is None else repr(r.eval_loss)
    lines = [f"{COMMAND}: {r.checkpoint} (step {r.step}), {r.workers} worker"
             f"{'' if r.workers == 1 else 's'}, held-out set of --data {r.data} "
             f"({r.held_out:,} samples)", f"eval_loss {loss}"]
    lines += [f"{name} {value!r}" for name, value in r.eval_metrics.items()]
    if r.recorded is not None:
        if r.matches:
            lines.append(f"the run's own eval_loss at step {r.step}: the same, bit for bit")
        elif r.workers != r.was_workers:
            lines.append(f"the run's own eval_loss at step {r.step}: {r.recorded!r}, on "
                         f"{r.was_workers} workers: the same mean summed in another order "
                         f"(equal to float rounding; --workers {r.was_workers} gives its bits)")
        else:
            lines.append(f"the run's own eval_loss at step {r.step}: {r.recorded!r} (differs)")
    return lines


def as_json(r: Evaluated) -> dict:
    return {**dataclasses.asdict(r), "matches": r.matches}

