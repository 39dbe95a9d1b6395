"""The training loop every worker runs: under `gradsync train`, `torchrun -m gradsync.train`
or :func:`gradsync.train`.

Three parts, one file each: ``worker/setup.py`` builds the :class:`Session` (run
directory, lock, resume decision, strategy, restored state), :func:`run_step`
(``step/train_step.py``) takes one optimizer step, exact over the global batch and
guarded against NaN, and :func:`finish` (``records/summary.py``) ends the run
(summary.json, table, report). Between steps, here: the bucket plan for the report,
the drift check, checkpoints, a fault injector's clean stop, and rank 0's callbacks
(``records/callbacks.py``). Who takes part in each step is the session's step
coordinator (``step/coordinator.py``, chosen once in setup): the loop asks it which step
comes next, tells it when a step ended, committed or not, and after the last step asks
it for the run's end (across replica groups, agreed with the other groups), and knows
nothing else of replica groups.
"""

from __future__ import annotations

import contextlib
import signal
import time

from ... import sigint
from ...observe import host_reads
from ..checkpoint.state import save
from ..config.run_config import RunConfig
from ..records.callbacks import Callbacks
from ..records.summary import finish
from ..records.trackers.base import FAILED, KILLED, Outcome
from ..step.monitor import Verdict
from ..step.train_step import run_step
from .faults import FaultInjector
from .session import Session
from .setup import setup


def _between_steps(sess: Session, step: int, verdict: Verdict) -> bool:
    """Plan, drift, checkpoint after step ``step``; True: stop here (a clean preemption).

    ``verdict``: what this step's evaluation decided (``step/monitor.py``): a new best is
    saved now, to be kept (``--keep-best``), and so is the step an early stop ends on."""
    cfg = sess.cfg
    last = step == cfg.run.steps or verdict.stop
    if step in (sess.start_step + 1, cfg.run.steps) or verdict.stop or (
            sess.inst.window and step == sess.inst.window[1]):
        sess.inst.write_plan(sess.strategy)
    sess.inst.maybe_check_drift(step, sess.strategy, last=verdict.stop)  # where replicas agree
    stop = sess.faults.stop_after(step)
    every = cfg.run.checkpoint_every
    if last or stop or verdict.best or (every and step % every == 0):
        save(sess, step)
        sess.last_checkpoint = step
        if sess.trackers:  # the steps a resume would not compute again: final for W&B, MLflow
            sess.trackers.committed(step)
    return stop


def train_session(sess: Session, callbacks=None) -> dict | None:
    """Run the steps left and finish; rank 0 returns the summary (a dict), others None."""
    cfg = sess.cfg
    hooks = Callbacks(callbacks, sess.rank)
    sess.loop_started = time.perf_counter()
    steps = sess.coordinator  # who takes part in each step (step/coordinator.py)
    with sess.display if sess.display else contextlib.nullcontext():
        step = sess.start_step + 1
        while step <= cfg.run.steps:
            step = steps.begin(step)  # across groups: a group that was behind jumps ahead
            if step > cfg.run.steps:
                break
            if host_reads.enabled():  # device values the step reads (a test holds it)
                with host_reads.HostReads() as reads:
                    rec = run_step(sess, step, reads)
            else:
                rec = run_step(sess, step)
            steps.end_step(step, rec is not None)
            if rec is None:  # the step did not commit: the same step again, same samples
                continue
            step += 1
            hooks.step_ended(sess, rec)
            verdict = sess.watch.observe(rec.step, rec.eval_loss, rec.eval_metrics)
            stop = _between_steps(sess, rec.step, verdict)
            if sess.last_checkpoint == rec.step:
                hooks.saved(sess, rec)
            if stop:
                if sess.display:
                    sess.display.say(f"gradsync train: stopped after step {rec.step} (checkpoint "
                                     "saved); run the same command again to continue")
                return None
            if verdict.stop:  # --early-stop: this step's checkpoint ends the run
                if sess.display:
                    sess.display.say(f"gradsync train: early stop: {sess.watch.stop_line()}")
                break
        if steps.end():  # across groups, the job's end (ft/closing.py); True: this group
            save(sess, cfg.run.steps)  # healed into the last step: its checkpoint
            sess.last_checkpoint = cfg.run.steps
            if sess.trackers:  # the steps a resume would not compute again
                sess.trackers.committed(cfg.run.steps)
    sess.finished = True
    return finish(sess)


def run_worker(cfg: RunConfig, model_fn=None, data_fn=None, faults: FaultInjector | None = None,
               prepared: bool = False, factories: dict | None = None,
               callbacks: list | None = None) -> dict | None:
    """Train on this rank; rank 0 returns the run summary (a dict), the others ``None``.

    ``cfg``: the run's config, resolved once by whoever started the worker (the object
    itself, pickled to a launched worker; never parsed again).
    ``model_fn``/``data_fn`` override ``--model``/``--data`` (see ``train/task/build.py`` for
    their contracts). ``prepared``: the launching process checked the run directory,
    verified the checkpoint and holds the lock (``launcher/preflight.py``). ``factories``:
    ``--optimizer``/``--scheduler`` given from Python as functions, by the names the
    config records (``launcher/api.take_factories``); ``callbacks``: run on rank 0
    (``records/callbacks.py``).
    """
    # SIGINT and SIGTERM (the launcher's stop) unwind like Ctrl-C, once: the clean-up they
    # start (the trackers' close above all) is not cut short by the next (gradsync.sigint)
    previous = sigint.interrupt_once()
    try:
        sess = setup(cfg, model_fn, data_fn, faults, prepared, factories)
        if sess is None:  # already finished: nothing to do, nothing written
            return None
        outcome = None  # finished, or (a clean stop) killed: the session knows
        try:
            return train_session(sess, callbacks)
        except KeyboardInterrupt:
            outcome = Outcome(KILLED, sigint.stop_signal() or signal.SIGINT)
            raise
        except BaseException:
            outcome = Outcome(FAILED)
            raise
        finally:
            with sigint.stopping():
                sess.close(outcome)
    finally:
        # Not past the loop: a SIGTERM during interpreter exit raised KeyboardInterrupt
        # inside an atexit callback ("Exception ignored in atexit callback").
        for signum, handler in previous.items():
            signal.signal(signum, handler)
