"""Judging slow-link runs: time to the target loss, and the fraction of the bound.

The target is the held-out loss torch DDP has at the end of its budget; a method's
time to target is its training time (step times summed, evaluations not counted)
until its first evaluation within ``TOLERANCE`` of it that is of one model (every
replica identical: always for exact methods, only at syncs and the end for local
updates). The bound is what no communication at all would need: DDP's steps to
the target at the no-sync run's median step time. ``slow_link.py``'s docstring
says what each figure means.
"""

from __future__ import annotations

import statistics

from slow_link_methods import LOCAL, SAMPLES_X

TOLERANCE = 1e-3
"""An evaluation within 0.1% of the target reaches it (exact methods' float32 sums differ
from DDP's in the last bits)."""


def summarise(rows: list[dict]) -> dict:
    """Per-run figures from metrics.jsonl: the curve and the per-step medians."""
    train_t, curve = 0.0, []
    for r in rows:
        train_t += r["step_time_s"]
        if r.get("eval_loss") is not None:
            curve.append((r["step"], train_t, r["eval_loss"]))
    steady = [r["step_time_s"] for r in rows[2:-1]] or [r["step_time_s"] for r in rows]
    sent = [r.get("sent_bytes") or 0 for r in rows]
    return {"curve": curve, "steps": len(rows), "median_step_s": statistics.median(steady),
            "train_s": train_t, "sent_bytes_per_step": sum(sent) / max(1, len(sent)),
            "final_eval": curve[-1][2] if curve else None}


def comparable(method: str, step: int, last: int, quick_h: dict) -> bool:
    """Is the model at ``step`` one model (every replica identical)?"""
    if method not in LOCAL:
        return True
    h = quick_h.get(method, LOCAL[method])
    return step == last or (h is not None and step % h == 0)


def judge(results: dict, workload: str, rate: str, quick_h: dict) -> list[dict]:
    """The table's rows for one (workload, rate): time to target, fraction of bound."""
    runs = results.get(workload, {}).get(rate, {})
    anchor = runs.get("torch-ddp")
    if not anchor or anchor.get("final_eval") is None:
        return []
    target = anchor["final_eval"]
    limit = target * (1 + TOLERANCE)

    def reach(run, method):
        last = run["steps"]
        for step, t, loss in run["curve"]:
            if loss <= limit and comparable(method, step, last, quick_h):
                return step, t
        return None, None

    anchor_step, anchor_t = reach(anchor, "torch-ddp")
    bound_run = runs.get("no-sync")
    bound_t = anchor_step * bound_run["median_step_s"] if bound_run and anchor_step else None
    exact_step = runs.get("exact", {}).get("median_step_s")
    rows = []
    for method, run in runs.items():
        step, t = reach(run, method) if method != "no-sync" else (None, None)
        label = f"{method} ({SAMPLES_X[method]}x samples)" if method in SAMPLES_X else method
        rows.append({
            "method": label, "target": target, "steps_to_target": step, "time_to_target_s": t,
            "speedup_vs_ddp": anchor_t / t if t and anchor_t else None,
            "fraction_of_bound": bound_t / t if t and bound_t else None,
            "bound_s": bound_t, "median_step_s": run["median_step_s"],
            "per_step_vs_exact": exact_step / run["median_step_s"] if exact_step else None,
            "sent_mb_per_step": run["sent_bytes_per_step"] / 1e6,
            "link_mb_per_step": (run["link_bytes_per_step"] / 1e6
                                 if run.get("link_bytes_per_step") is not None else None),
            "final_eval": run["final_eval"],
            "final_vs_target": (run["final_eval"] / target - 1) if run["final_eval"] else None,
        })
    return rows
