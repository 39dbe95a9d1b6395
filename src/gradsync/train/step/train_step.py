"""One optimizer step of `gradsync train`, and the held-out evaluation.

A step draws its global batch from the :class:`StepSampler`; the session's step
coordinator (``coordinator.py``) deals it over the ranks (evenly, ``block[r::K]``,
unless ``--balance`` measured a rank slower and handed it fewer samples; across replica
groups, over the quorum's ranks) and cuts this rank's part into micro-batches; runs all but
the last micro-batch under ``no_sync()`` and calls ``backward(loss,
num_items=n)``, so the gradient is the exact mean over every item of the global
batch. Then, before the optimizer may touch anything: the global gradient norm
(clipped to ``--clip`` when it is set; off by default, as in torch DDP, but always
measured: the NaN guard reads it) and one all-gather of every rank's loss sum, item count,
gradient norm and step figures. Every rank so learns the exact global mean loss
and whether any rank saw a NaN or inf -- and decides alike: ``--on-nonfinite
stop`` raises on every rank before the update (no checkpoint can hold a diverged
model), ``skip-step`` drops the update on every rank. With fp16 an overflowed gradient
is first loss scaling's (``engine/sync/loss_scale.py``): the engine dropped it on every
rank and halved the scale, the step is skipped and recorded (``overflow``), and
``--on-nonfinite`` sees only a non-finite loss, or a gradient that overflowed even at
the minimum scale.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Mapping

import torch

from ...engine.transport import comm, host, tracing
from ...errors import GradsyncError
from ...rundir import StepRecord
from ..task.eval_metrics import metric_sums, metric_values
from ..worker.session import Session


class NonFiniteError(GradsyncError):
    """A NaN or inf loss or gradient norm; raised on every rank before the update."""


def _nonfinite(rows: list[list[float]], step: int, norms: bool = True) -> str | None:
    for col, what in ((0, "loss"), (2, "gradient norm"))[:2 if norms else 1]:
        values = [row[col] for row in rows]
        ranks = [r for r, v in enumerate(values) if not math.isfinite(v)]
        if ranks:
            return (f"non-finite {what} ({values[ranks[0]]}) at step {step} on rank(s) "
                    f"{', '.join(map(str, ranks))}")
    return None


def _forward(model, x):
    """``model(**x)`` for a dict input (transformers' convention), else ``model(x)``."""
    return model(**x) if isinstance(x, Mapping) else model(x)


def run_step(sess: Session, step: int, reads=None) -> StepRecord | None:
    """Train step ``step`` (1-based); rank 0 also writes its metrics line.

    ``reads``: a running ``observe.host_reads.HostReads`` whose count the line records.

    Who takes part is the session's coordinator (``coordinator.py``): it deals the
    block, sums beyond this group where there is more (replica groups), and says whether
    the step commits. None: it did not (a group failed), nothing was updated and the
    sampler is back where it was, so the step is taken again on the same samples.
    """
    cfg, strategy, task, steps = sess.cfg, sess.strategy, sess.task, sess.coordinator
    model = strategy.model
    reads0 = host.reads  # the engine's own reads of device values (its one door)
    sess.inst.begin_step(step)
    t0 = time.perf_counter()
    before = sess.sampler.state_dict()  # a step that does not commit takes them again
    block = sess.sampler.next_block()
    share, micro = steps.deal(block)
    # the loss sum stays on the device: read once per step, with the other figures
    loss_sum = torch.zeros((), dtype=torch.float64, device=sess.device)
    items = 0
    batches = sess.batches.step(micro)  # collated here, or by --loader-workers (task/loader.py)
    for k in range(len(micro)):
        last = k == len(micro) - 1
        poison = last and sess.faults.at_step(sess.rank, step, model.module)
        sess.slowdown.before_micro_batch()
        x, y = next(batches)
        n = task.items(x, y)  # on the host, before the copy: no device read
        x, y = host.batch_to((x, y), sess.device)
        with contextlib.nullcontext() if last else model.no_sync():
            loss = task.data.loss_fn(_forward(model, x), y)
            if poison:
                loss = loss * float("nan")
            sess.slowdown.before_backward(step)  # --straggler: slow before the gradient leaves
            model.backward(loss, num_items=n)
        if n:  # a micro-batch of padding only: its loss is 0/0 and counts for nothing
            loss_sum += loss.detach().to(torch.float64) * n
        items += n
        sess.slowdown.after_micro_batch(step)
    busy = sess.inst.busy_s(t0)
    with tracing.span("optimizer"):
        steps.reduce(items, loss_sum)  # across groups: the quorum's exact mean gradient
        norm_t = strategy.clip_grad_norm_(cfg.optim.clip)
        stats = sess.inst.gather_stats(loss_sum, float(items), norm_t, len(share), busy)
        rows = stats.tolist()  # the table is on the host: one conversion for every figure
        norm = rows[sess.rank][2]
        total_items, loss_total = steps.totals(stats)
        global_loss = loss_total / max(total_items, 1)
        lr = strategy.optimizer.param_groups[0]["lr"]
        scaler = strategy.loss_scaler  # fp16: an overflow is a step skipped, not a problem
        overflow = scaler is not None and scaler.verdict == "overflow"
        problem = _nonfinite(rows, step, norms=not overflow)
        if problem and scaler is not None and scaler.verdict == "nonfinite":
            problem += f" (it overflowed even at the minimum loss scale, {scaler.used:g})"
        problem = problem or steps.problem(global_loss, step)
        if not steps.commit():  # a group failed: redo, same samples, next quorum
            sess.sampler.load_state_dict(before)
            strategy.zero_grad()
            return None
        if problem is None and not overflow:
            strategy.optimizer.step()
            strategy.after_step(int(total_items))
        elif problem is not None and cfg.optim.on_nonfinite == "skip-step":
            sess.skipped.append(step)
        if step == cfg.run.steps:
            strategy.finish()
        with warnings.catch_warnings():  # torch's "before optimizer.step()": fp16's first
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()`")
            sess.sched.step()  # a skipped step still counts: the schedule follows step numbers
        if step == cfg.run.steps:  # the summary's report: the step at its fullest,
            sess.memory = strategy.memory_report()  # gradients and optimizer state both held
        strategy.zero_grad()
    step_s = time.perf_counter() - t0
    sess.step_times.append(step_s)
    figures = sess.inst.step_figures(rows, step_s)  # the step's own, before any evaluation
    saved = steps.observe(step, figures["share_by_rank"], figures["busy_s_by_rank"])
    sess.inst.end_step(step)
    stop = problem is not None and cfg.optim.on_nonfinite == "stop"
    share = len(block) // sess.world  # a training step's share: what evaluation takes at once
    eval_loss, eval_metrics = (None, None) if stop else maybe_evaluate(sess, step, share)
    sess.last_loss = global_loss
    sess.items_per_step = int(total_items)
    rate = total_items / step_s
    rec = StepRecord(step=step, loss=global_loss, lr=lr, items=int(total_items),
                     world_size=steps.world_size, grad_norm=None if problem or overflow else norm,
                     skipped=problem is not None or overflow, eval_loss=eval_loss,
                     overflow=(overflow and problem is None) or None,
                     loss_scale=scaler.used if scaler is not None else None,
                     eval_metrics=eval_metrics,
                     time_s=time.perf_counter() - sess.loop_started, unix_time=time.time(),
                     samples_per_s=len(block) / step_s,
                     tokens_per_s=rate if sess.unit == "tokens" else None,
                     balance_saved_s=saved,
                     host_reads=reads.count + host.reads - reads0 if reads else None,
                     **figures,
                     **steps.record(strategy.step_report()))
    if sess.baseline_rate:
        rec.scaling_efficiency = rec.samples_per_s / (sess.world * sess.baseline_rate)
    if sess.rank == 0:
        sess.writer.write(rec)
        sess.display.update(step, global_loss, rate, step_s, eval_loss)
        if problem is not None and not stop:
            sess.display.say(f"gradsync train: {problem}: update skipped on every rank")
    if stop:
        last = sess.last_checkpoint
        where = (f"the last checkpoint (step {last}) is intact" if last else
                 "no checkpoint had been written yet")
        raise NonFiniteError(f"{problem}; stopped before the optimizer update, so no checkpoint "
                             f"holds it and {where}. If the loss was finite before, lower "
                             "--lr; else look for NaN/inf in the data or the model (or pass "
                             "--on-nonfinite skip-step), then run the same command again")
    return rec


def maybe_evaluate(sess: Session, step: int, share: int) -> tuple[float | None, dict | None]:
    """(held-out loss, metrics) on an evaluation step, else (None, None)."""
    every = sess.cfg.observe.eval_every
    if not every or sess.task.data.eval is None:
        return None, None
    if step % every and step != sess.cfg.run.steps:
        return None, None
    sess.last_eval, metrics = evaluate(sess, share)
    return sess.last_eval, metrics if sess.task.data.metrics else None


@torch.no_grad()
def evaluate(sess: Session, share: int) -> tuple[float | None, dict[str, float]]:
    """The exact mean loss over the whole held-out set, the same number on every rank,
    and ``TrainData.metrics`` over it (``task/eval_metrics.py``), in the same all-reduce.

    Rank ``r`` takes samples ``r, r + K, ...``, ``share`` at a time (a training step's)
    (no activations are kept for backward, so a forward of that size fits); every
    rank runs the same number of forwards (ZeRO-3 gathers parameters inside
    forward, a collective), a rank with nothing left running one on sample 0 that
    counts for nothing.
    """
    data, task, model = sess.task.data.eval, sess.task, sess.strategy.model
    metrics = task.data.metrics
    mine = list(range(sess.rank, len(data), sess.world))
    m = share
    rounds = math.ceil(math.ceil(len(data) / sess.world) / m)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=sess.device)  # read once, below
    total = torch.zeros(2 + 2 * len(metrics or ()), dtype=torch.float64)
    try:
        for r in range(rounds):
            idx = mine[r * m:(r + 1) * m]
            x, y = task.collate(data, idx or [0])
            n = task.items(x, y) if idx else 0  # on the host, before the copy
            x, y = host.batch_to((x, y), sess.device)
            out = _forward(model, x)  # every rank, every round (see above)
            if n:  # none: nothing left here, or padding only (its loss is 0/0)
                loss_sum += task.data.loss_fn(out, y).to(torch.float64) * n
                total[1] += n
            if idx and metrics:
                total[2:] += torch.tensor(metric_sums(metrics, out, y), dtype=torch.float64)
    finally:
        model.train(was_training)
    total = total.to(sess.device)
    total[0] = loss_sum
    comm.all_reduce(total, tag="eval_loss")
    total = host.read(total)
    loss = float(total[0] / total[1]) if total[1] > 0 else None  # None: no held-out items
    return loss, metric_values(metrics, total[2:])
