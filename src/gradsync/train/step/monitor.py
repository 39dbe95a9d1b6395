"""A held-out metric watched between steps: the best so far (``--keep-best``) and patience
(``--early-stop``).

What users of Lightning's ``ModelCheckpoint(monitor=..., mode=...)`` and
``EarlyStopping(monitor, patience, min_delta)``, and of transformers' Trainer
(``metric_for_best_model``, ``early_stopping_patience``), reach for first. The decisions:

* **What is watched**: ``eval_loss`` (the exact held-out loss, ``train_step.evaluate``) or
  a metric of the data's ``TrainData.metrics`` by its name (``accuracy``; the trackers'
  spelling ``eval_metrics/accuracy`` is accepted too). A metric the data does not have is
  refused when the task is built (:func:`check_watched`), naming the ones it has.
* **Direction**: ``NAME:min`` or ``NAME:max``; without one, ``min`` (a loss), as
  Lightning's default ``mode="min"``. An accuracy needs ``:max``, and says so nowhere
  else, so the docs say it.
* **When**: only on the steps that evaluate (``--eval-every`` and the last step); every
  such value is the same number on every rank (it comes out of one all-reduce), so every
  rank decides alike and no collective is needed to agree.
* **Best**: strictly better than the best so far (a tie keeps the earlier checkpoint); a
  NaN is never better.
* **Early stopping**: ``NAME[:min|:max]:PATIENCE[:MIN_DELTA]``. An evaluation improves
  when it beats the best by more than ``MIN_DELTA`` (default 0; Lightning's rule); after
  ``PATIENCE`` evaluations in a row that do not, the run stops after that step, with a
  checkpoint, and the summary says where and why. Patience counts evaluations, not steps,
  as Lightning's and transformers' do: ``--eval-every`` sets how long that is.
* **Surviving a resume**: the state (best value and step, the evaluations without
  improvement, where the run stopped) is in every checkpoint (``Watch.state_dict``), so
  a continued run decides exactly as the uninterrupted one would; evaluations after the
  checkpoint are taken again and counted again.

Parsed here, where it is read, and called from ``config/resolve.py`` (as ``--straggler``
is from ``straggler.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ...errors import UsageError

LOSS = "eval_loss"
MODES = ("min", "max")
_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")


@dataclass(frozen=True)
class Monitor:
    """A held-out figure and which way is better."""

    name: str  # "eval_loss" or a TrainData.metrics key
    mode: str = "min"

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.mode}"

    def value(self, eval_loss: float | None, eval_metrics: dict | None) -> float | None:
        """This evaluation's value of the figure (None: not evaluated at this step)."""
        if self.name == LOSS:
            return eval_loss
        return (eval_metrics or {}).get(self.name)

    def better(self, new: float, best: float | None, by: float = 0.0) -> bool:
        """``new`` beats ``best`` by more than ``by`` (a NaN never does)."""
        if new is None or not math.isfinite(new):
            return False
        if best is None:
            return True
        return new < best - by if self.mode == "min" else new > best + by


@dataclass(frozen=True)
class EarlyStop:
    """``--early-stop``: stop after ``patience`` evaluations without an improvement."""

    monitor: Monitor
    patience: int
    min_delta: float = 0.0


def _monitor(name: str, mode: str | None, flag: str, text: str) -> Monitor:
    if name.startswith("eval_metrics/"):
        name = name[len("eval_metrics/"):]
    if not name or not _NAME.match(name):
        raise UsageError(f"{flag} {text!r}: name a held-out figure, eval_loss or one of your "
                         "TrainData.metrics (e.g. accuracy:max)")
    return Monitor(name, mode or "min")


def parse_monitor(text: str, flag: str = "--keep-best") -> Monitor | None:
    """``NAME[:min|:max]`` -> Monitor; "" -> None."""
    text = (text or "").strip()
    if not text:
        return None
    name, _, mode = text.partition(":")
    if mode and mode not in MODES:
        raise UsageError(f"{flag} takes NAME[:min|:max] (e.g. eval_loss, accuracy:max), "
                         f"got {text!r}")
    return _monitor(name, mode or None, flag, text)


def parse_early_stop(text: str) -> EarlyStop | None:
    """``NAME[:min|:max]:PATIENCE[:MIN_DELTA]`` -> EarlyStop; "" -> None."""
    text = (text or "").strip()
    if not text:
        return None
    usage = ("--early-stop takes NAME[:min|:max]:PATIENCE[:MIN_DELTA], e.g. eval_loss:5 or "
             f"accuracy:max:3:0.001 (patience: evaluations without improvement), got {text!r}")
    parts = text.split(":")
    name, rest = parts[0], parts[1:]
    mode = None
    if rest and rest[0] in MODES:
        mode, rest = rest[0], rest[1:]
    if len(rest) not in (1, 2):
        raise UsageError(usage)
    try:
        patience = int(rest[0])
        delta = float(rest[1]) if len(rest) == 2 else 0.0
    except ValueError:
        raise UsageError(usage) from None
    if patience < 1 or not (math.isfinite(delta) and delta >= 0):
        raise UsageError(f"--early-stop {text}: PATIENCE must be >= 1 and MIN_DELTA a number "
                         ">= 0")
    return EarlyStop(_monitor(name, mode, "--early-stop", text), patience, delta)


def check_watched(monitors, metrics, eval_set) -> None:
    """Refuse, in one line, a watched figure the data cannot give (when the task is built:
    a factory's metrics are known only once it has run)."""
    for flag, m in monitors:
        if m is None:
            continue
        if eval_set is None:
            raise UsageError(f"{flag} {m.name} watches the held-out set, and the data has none: "
                             "give gradsync.TrainData an eval dataset, or drop the flag")
        if m.name != LOSS and m.name not in (metrics or {}):
            have = ", ".join([LOSS, *(metrics or {})])
            raise UsageError(f"{flag} {m.name}: the data has no metric {m.name!r}; watch one of "
                             f"{have} (a metric is TrainData.metrics={{name: fn}})")


@dataclass
class Verdict:
    """What an evaluation decided: a new best (save it, keep it), stop here."""

    best: bool = False
    stop: bool = False


@dataclass
class Watch:
    """The state of ``--keep-best`` and ``--early-stop``, checkpointed with every save."""

    keep_best: Monitor | None = None
    early_stop: EarlyStop | None = None
    best: dict | None = None  # {"value", "step"}: the kept best checkpoint's figure
    stop: dict = field(default_factory=dict)  # {"best", "best_step", "bad", "stopped"}
    notes: list[str] = field(default_factory=list)  # what a resume changed, said once

    @property
    def active(self) -> bool:
        return self.keep_best is not None or self.early_stop is not None

    def observe(self, step: int, eval_loss: float | None, eval_metrics: dict | None) -> Verdict:
        """The evaluation of ``step`` (None: not evaluated), judged; the state updated."""
        v = Verdict()
        if self.keep_best is not None:
            value = self.keep_best.value(eval_loss, eval_metrics)
            if value is not None and self.keep_best.better(
                    value, self.best["value"] if self.best else None):
                self.best = {"value": value, "step": step}
                v.best = True
        es = self.early_stop
        if es is not None and not self.stop.get("stopped"):
            value = es.monitor.value(eval_loss, eval_metrics)
            if value is not None:
                if es.monitor.better(value, self.stop.get("best"), es.min_delta):
                    self.stop.update(best=value, best_step=step, bad=0)
                else:
                    self.stop["bad"] = self.stop.get("bad", 0) + 1
                if self.stop["bad"] >= es.patience:
                    self.stop["stopped"] = step
                    v.stop = True
        return v

    @property
    def stopped(self) -> int | None:
        return self.stop.get("stopped")

    def state_dict(self) -> dict:
        return {"keep_best": self.keep_best.spec if self.keep_best else None,
                "best": dict(self.best) if self.best else None,
                "early_stop": _es_spec(self.early_stop), "stop": dict(self.stop)}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's state; a figure watched differently now starts afresh (said)."""
        state = state or {}
        if self.keep_best is not None:
            if state.get("keep_best") == self.keep_best.spec:
                self.best = state.get("best")
            elif state.get("keep_best"):
                self.notes.append(f"--keep-best is now {self.keep_best.spec}, was "
                                  f"{state['keep_best']}: the best is chosen afresh from here")
        if self.early_stop is not None:
            if state.get("early_stop") == _es_spec(self.early_stop):
                self.stop = dict(state.get("stop") or {})
            elif state.get("early_stop"):
                self.notes.append(f"--early-stop is now {_es_spec(self.early_stop)}, was "
                                  f"{state['early_stop']}: its patience counts afresh from here")

    def summary(self) -> dict | None:
        """summary.json's ``early_stop`` (None without the flag)."""
        es = self.early_stop
        if es is None:
            return None
        return {"monitor": es.monitor.name, "mode": es.monitor.mode, "patience": es.patience,
                "min_delta": es.min_delta, "stopped_at": self.stop.get("stopped"),
                "best": self.stop.get("best"), "best_step": self.stop.get("best_step"),
                "evaluations_without_improvement": self.stop.get("bad", 0)}

    def stop_line(self) -> str:
        """The early stop in words (the summary's row, the "finished" line)."""
        es, s = self.early_stop, self.stop
        if es is None:
            return "off"
        if not s.get("stopped"):
            return (f"{es.monitor.spec}, patience {es.patience}: not triggered "
                    f"({s.get('bad', 0)} evaluation(s) without improvement at the end)")
        best = (f"best {s['best']:.6g} at step {s.get('best_step')}"
                if s.get("best") is not None else "never a finite value")
        return (f"stopped after step {s['stopped']}: {es.monitor.name} did not improve "
                f"{'by more than ' + format(es.min_delta, 'g') + ' ' if es.min_delta else ''}"
                f"in {es.patience} evaluation(s); {best}")


def _es_spec(es: EarlyStop | None) -> str | None:
    if es is None:
        return None
    return f"{es.monitor.spec}:{es.patience}:{es.min_delta:g}"


def stopped_early(state: dict | None, early_stop: EarlyStop | None) -> int | None:
    """The step a checkpoint's run stopped early at, if it did under this ``--early-stop``
    (a run continued with another value, or without one, trains on)."""
    state = state or {}
    stopped = (state.get("stop") or {}).get("stopped")
    if stopped and early_stop is not None and state.get("early_stop") == _es_spec(early_stop):
        return int(stopped)
    return None
