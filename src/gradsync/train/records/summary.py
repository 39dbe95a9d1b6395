"""The end of a run: summary.json, the closing table, the memory report, report.html.

Also a finished run's lost or damaged summary.json, given back from its metrics
(:func:`repair_summary`): the launcher and rank 0 of a worker group both say "already
finished" and repair it.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ...engine.strategy.inexact import LocalUpdateStrategy
from ...observe.balance_view import measured_saving, saving_text
from ...observe.exactness import drift_text
from ...observe.traffic import run_traffic, traffic_line
from ...rundir import (
    KEPT,
    METRICS,
    SUMMARY,
    Summary,
    precision_text,
    read_metrics,
    strategy_text,
    sync_description,
    write_json,
)
from ..worker.session import Session
from .instrument import write_report_safely


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    steady = sorted(values[min(3, len(values) - 1):])
    return steady[len(steady) // 2]


def _skipped(sess: Session) -> list[int]:
    """Steps whose update was skipped as non-finite over the whole run (all attempts), from
    metrics.jsonl (a step skipped by loss scaling is counted apart, ``loss_scale``)."""
    rows, _ = read_metrics(os.path.join(sess.cfg.run.out, METRICS))
    return sorted({r["step"] for r in rows if r.get("skipped") and not r.get("overflow")}
                  | set(sess.skipped))


def gradient_bytes(strategy) -> list[int] | None:
    """What an exact all-reduce of one step's gradients reduces: each bucket's bytes, or the
    whole trainable gradient for a local-update run (no buckets); None for zero3, whose
    units reduce per wrapped module and record no bytes sent."""
    if strategy.bucket_plan:
        return [int(b.nbytes) for b in strategy.bucket_plan]
    if isinstance(strategy, LocalUpdateStrategy):
        return [sum(p.numel() * p.element_size() for p in strategy.module.parameters()
                    if p.requires_grad)]
    return None


def build_summary(sess: Session) -> Summary:
    cfg, strategy = sess.cfg, sess.strategy
    median = _median(sess.step_times)
    tuned = strategy.autotune_result
    mem = sess.memory or strategy.memory_report()
    per_step_items = None
    if sess.unit == "tokens" and median and sess.items_per_step:
        per_step_items = sess.items_per_step / median
    summary = Summary(
        model=cfg.run.model, data=cfg.run.data, strategy=cfg.sync.strategy,
        precision=cfg.sync.precision, optimizer=cfg.optim.optimizer_name, seed=cfg.run.seed,
        steps=cfg.run.steps, world_size=sess.world, accumulation=sess.plan.accumulation,
        global_batch=cfg.batch.global_batch, micro_batch=cfg.batch.micro_batch,
        final_loss=sess.last_loss, final_eval_loss=sess.last_eval,
        resumed_from=sess.start_step, world_sizes=list(sess.world_sizes),
        median_step_s=median, samples_per_s=cfg.batch.global_batch / median if median else None,
        tokens_per_s=per_step_items, train_wall_s=time.perf_counter() - sess.loop_started,
        total_wall_s=time.perf_counter() - sess.started, checkpoint=sess.ckpt_path,
        buckets=len(strategy.bucket_plan), bucket_cap_mb=strategy.bucket_cap_mb,
        skipped_steps=_skipped(sess), memory=dataclasses.asdict(mem),
        drift=sess.inst.drift, traced_steps=list(sess.inst.window) if sess.inst.window else None,
        autotune=None if tuned is None else {"candidates_mb": tuned.candidates_mb,
                                             "median_s": tuned.median_s,
                                             "chosen_mb": tuned.chosen_mb})
    summary.gradient_bytes = gradient_bytes(strategy)
    summary.collectives = getattr(strategy, "collectives", None)
    rows, _ = read_metrics(os.path.join(cfg.run.out, METRICS))  # every attempt's steps
    scaler = strategy.loss_scaler  # fp16: the steps its overflows skipped, the scale now
    if scaler is not None:
        summary.loss_scale = {"skipped": len({r["step"] for r in rows if r.get("overflow")}),
                              "scale": scaler.scale}
    summary.fault_tolerance = sess.coordinator.summary(rows)  # across replica groups
    summary.kept, summary.early_stop = kept_summary(sess), sess.watch.summary()
    traffic = run_traffic(rows, summary.gradient_bytes)
    if traffic is not None:
        summary.sent_bytes, summary.exact_bytes = traffic.sent, traffic.exact
    if sess.baseline_rate and summary.samples_per_s:
        summary.baseline_samples_per_s = sess.baseline_rate
        summary.scaling_efficiency = summary.samples_per_s / (sess.world * sess.baseline_rate)
    return summary


def _f(v, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{format(v, spec)}{unit}"


def finish(sess: Session) -> dict | None:
    """Rank 0: write summary.json, print the table and memory, draw the report."""
    if sess.rank != 0:
        return None
    cfg, s = sess.cfg, build_summary(sess)
    write_json(os.path.join(cfg.run.out, SUMMARY), s.to_json())
    run = {**cfg.to_dict(), "param_dtype": sess.param_dtype}  # what the tables name
    tuned = sess.strategy.autotune_result
    rate = s.tokens_per_s if sess.unit == "tokens" else s.samples_per_s
    sizes = " -> ".join(map(str, s.world_sizes))
    rows = [
        ("final loss", _f(s.final_loss, ".4f")),
        ("final eval loss", _f(s.final_eval_loss, ".4f") if cfg.observe.eval_every else "off"),
        (f"throughput ({sess.unit}/s, median step)", _f(rate, ",.0f")),
        ("median step time", _f(s.median_step_s and s.median_step_s * 1e3, ".1f", " ms")),
        ("workers x accumulation", f"{s.world_size} x {s.accumulation}"
         + (f" (workers over the run: {sizes})" if len(s.world_sizes) > 1 else "")),
        ("strategy / precision / optimizer", f"{strategy_text(run)} / {precision_text(run)} / "
                                             f"{s.optimizer}"),
        ("synchronisation", sync_description(cfg.to_dict(), s.collectives)),
        ("seed", str(s.seed)),
        ("scaling efficiency vs 1 worker",
         f"{s.scaling_efficiency:.0%}" if s.scaling_efficiency
         else "n/a (1 worker)" if s.world_size == 1 else "(run with --baseline)"),
        ("bytes sent (rank 0)", _traffic_line(cfg, s)),
        ("drift check", _drift_line(sess)
         if sess.strategy.replicated or isinstance(sess.strategy, LocalUpdateStrategy)
         else f"n/a ({sess.strategy.not_replicated_because})"),
        ("gradient buckets", _buckets_line(s, tuned)),
        ("straggler balancing", _balance_line(sess)),
        ("wall time", f"{s.total_wall_s:.1f} s"),
        ("checkpoint", sess.ckpt_path),
    ]
    if s.fault_tolerance:
        rows.insert(-2, ("fault tolerance", sess.coordinator.summary_line(s.fault_tolerance)))
    if s.resumed_from:
        rows.insert(-1, ("resumed from step", str(s.resumed_from)))
    if s.skipped_steps:
        rows.insert(1, ("skipped steps (non-finite)", ", ".join(map(str, s.skipped_steps))))
    if s.loss_scale:
        rows.insert(-2, ("loss scaling (fp16)", loss_scale_line(s.loss_scale)))
    if s.kept:  # --keep-last, --keep-best, --early-stop (issue 37)
        rows.insert(-1, ("checkpoints kept", kept_line(s.kept)))
    if s.early_stop:
        rows.insert(-1, ("early stopping", sess.watch.stop_line()))
    sess.display.summary(rows, title=f"gradsync train: {cfg.run.model} on {cfg.run.data} "
                                     f"({strategy_text(run)}, {precision_text(run)})")
    mem = sess.memory or sess.strategy.memory_report()
    sess.display.console.print(mem.render(), highlight=False)
    if not cfg.observe.no_report:
        write_report_safely(cfg.run.out)
    return s.to_json()


def kept_summary(sess: Session) -> dict | None:
    """summary.json's ``kept``: the units ``--keep-last``/``--keep-best`` left (None: neither)."""
    cfg = sess.cfg.checkpoints
    if not cfg.keep_last and not cfg.best:
        return None
    best = sess.watch.best
    return {"last": list(sess.kept.last), "dir": os.path.join(sess.cfg.run.out, KEPT),
            "best": {"step": best["step"], "metric": cfg.best.spec, "value": best["value"]}
            if cfg.best and best else None}


def kept_line(kept: dict) -> str:
    """"last 3 (steps 80, 90, 100); best eval_loss 1.2345 at step 60, in runs/a/checkpoints"."""
    parts = []
    if kept.get("last"):
        steps = kept["last"]
        parts.append(f"last {len(steps)} (step{'s' * (len(steps) != 1)} "
                     f"{', '.join(map(str, steps))})")
    best = kept.get("best")
    if best:
        parts.append(f"best {best['metric'].split(':')[0]} {best['value']:.6g} at step "
                     f"{best['step']}")
    return ("; ".join(parts) or "none") + f", in {kept['dir']}"


def loss_scale_line(figures: dict) -> str:
    """"N steps skipped by loss scaling (scale now S)"."""
    n = figures["skipped"]
    return (f"{n} step{'s' * (n != 1)} skipped by loss scaling "
            f"(scale now {figures['scale']:g})")


def _traffic_line(cfg, s: Summary) -> str:
    rows, _ = read_metrics(os.path.join(cfg.run.out, METRICS))
    return traffic_line(run_traffic(rows, s.gradient_bytes), cfg.sync.strategy)


def _drift_line(sess: Session) -> str:
    """The drift check over the whole run (observe/exactness.drift_text's short form)."""
    drift = sess.inst.drift
    if not drift["every"]:
        return "off"
    if not drift["ok"]:
        return "FAILED"
    rows, _ = read_metrics(os.path.join(sess.cfg.run.out, METRICS))
    return drift_text(drift, sess.cfg.to_dict(), rows, short=True)


def _balance_line(sess: Session) -> str:
    """What --balance did over the whole run (every attempt), from metrics.jsonl."""
    cfg = sess.cfg
    if cfg.batch.balance == "off":
        return "off"
    if not cfg.batch.balanced:
        return "off (only with --sync exact and no --compress)"
    rows, _ = read_metrics(os.path.join(cfg.run.out, METRICS))
    uneven = [r for r in rows if len(set(r.get("share_by_rank") or [0])) > 1]
    if not uneven:
        return "on; even split throughout (no rank measured slower)"
    return (f"{len(uneven)} of {len(rows)} steps uneven (last {uneven[-1]['share_by_rank']}); "
            f"{saving_text(measured_saving(rows))}")


def _buckets_line(s, tuned) -> str:
    if s.buckets:
        return (f"{s.buckets} (cap {s.bucket_cap_mb:.2f} MiB"
                + (", auto-tuned)" if tuned and tuned.chosen_mb else ")"))
    return "per wrapped unit (zero3)" if s.strategy == "zero3" else "none (not bucketed)"


def repair_summary(out: str) -> None:
    """A finished run whose summary.json is corrupt or lost gets it back (from its metrics)."""
    from ...observe.run_data import repair_summary as repair

    note = repair(out)
    if note:
        print(f"gradsync train: {note}", flush=True)
