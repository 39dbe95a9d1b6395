"""Callbacks of ``gs.train(..., callbacks=[...])``: your code at the loop's three moments.

    class Logger(gs.Callback):
        def on_step_end(self, info): ...     # after every step's metrics line
        def on_eval(self, info): ...         # after a held-out evaluation
        def on_checkpoint(self, info): ...   # after a checkpoint is complete on disk

The decisions, and why:

* Rank 0 only. Everything a callback is told -- the exact global loss, the
  held-out loss and metrics, the checkpoint -- is the same number on every rank,
  and rank 0 is the rank that writes the run's files; calling every rank would
  make every side effect (a line sent to a tracker, a file copied) happen K times.
* Objects, pickled to the workers (``gs.train`` launches them): an instance of a
  class defined at module level (the caller's own script works, as ``model=``
  does), checked with ``pickle`` before any worker starts. Each worker process
  gets its own copy, so what a callback keeps in its attributes lives in rank 0's
  process and is gone when the run ends or restarts: write what must outlast it
  to a file (``info.out`` is the run directory).
* Order within a step: ``on_step_end``, then ``on_eval`` (if it evaluated), both
  before anything between steps (the drift check, saving), then ``on_checkpoint``
  (if it saved); callbacks in the order given. After a resume
  they are called from the first step that is computed again.
* They run inline: the other ranks wait for rank 0 at the next step's first
  collective, so a slow callback slows the run (keep them quick, or hand work to
  a thread). An exception in a callback fails the run like any error of rank 0
  (the last checkpoint stays intact; the same command continues it).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...errors import UsageError
from ...rundir import CHECKPOINT

HOOKS = ("on_step_end", "on_eval", "on_checkpoint")


@dataclass(frozen=True)
class CallbackInfo:
    """What a callback is told (rank 0's view; the figures are global).

    ``record`` is the step's metrics.jsonl line; ``checkpoint`` the path of
    ``checkpoint.pt`` in ``on_checkpoint`` (None otherwise).
    """

    step: int
    steps: int
    loss: float | None
    lr: float
    grad_norm: float | None
    skipped: bool
    eval_loss: float | None
    eval_metrics: dict[str, float]
    out: str
    record: dict = field(repr=False)
    checkpoint: str | None = None


class Callback:
    """A base class whose hooks do nothing: override the ones you need."""

    def on_step_end(self, info: CallbackInfo) -> None:
        """After a step's metrics line is written."""

    def on_eval(self, info: CallbackInfo) -> None:
        """After the held-out evaluation (``info.eval_loss``, ``info.eval_metrics``)."""

    def on_checkpoint(self, info: CallbackInfo) -> None:
        """After ``info.checkpoint`` is complete on disk (the run can continue from it)."""


def check_callbacks(callbacks) -> list:
    """The callbacks as a list, refused in one line if they cannot reach the workers."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        callbacks = [callbacks]
    for cb in callbacks:
        if isinstance(cb, type):
            raise UsageError(f"callbacks= takes instances, got the class {cb.__name__}: "
                             f"pass {cb.__name__}()")
        if not any(callable(getattr(cb, h, None)) for h in HOOKS):
            raise UsageError(f"callback {cb!r} has none of {', '.join(HOOKS)}")
        try:
            pickle.dumps(cb)
        except Exception as e:  # lambdas, local classes, open files, locks ...
            raise UsageError(f"callback {type(cb).__qualname__} cannot reach the workers, "
                             f"which get a pickled copy ({type(e).__name__}: {e}); define "
                             "its class at module level and keep no open handles in it") from None
    return list(callbacks)


class Callbacks:
    """Rank 0's callbacks, called by the loop (``worker/loop.py``); a no-op on other ranks."""

    def __init__(self, callbacks, rank: int):
        self.callbacks = list(callbacks or ()) if rank == 0 else []

    def _call(self, hook: str, info: CallbackInfo) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if callable(fn):
                fn(info)

    def _info(self, sess, rec) -> CallbackInfo:
        return CallbackInfo(step=rec.step, steps=sess.cfg.run.steps, loss=rec.loss, lr=rec.lr,
                            grad_norm=rec.grad_norm, skipped=rec.skipped,
                            eval_loss=rec.eval_loss, eval_metrics=dict(rec.eval_metrics or {}),
                            out=sess.cfg.run.out, record=rec.to_json())

    def step_ended(self, sess, rec) -> None:
        """A step is done (its line written, evaluated if due), before anything between
        steps (the drift check, the checkpoint): what a callback measures then is the
        step's own, not the saving's (the benchmark's link bytes)."""
        if not self.callbacks:
            return
        info = self._info(sess, rec)
        self._call("on_step_end", info)
        if rec.eval_loss is not None or rec.eval_metrics:
            self._call("on_eval", info)

    def saved(self, sess, rec) -> None:
        """The checkpoint after step ``rec.step`` is complete on disk."""
        if self.callbacks:
            path = os.path.join(sess.cfg.run.out, CHECKPOINT)
            self._call("on_checkpoint", replace(self._info(sess, rec), checkpoint=path))
