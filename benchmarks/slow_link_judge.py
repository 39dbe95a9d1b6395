"""Judging slow-link runs over several seeds: the target, time to it, spreads, the bound.

Every method runs once per seed. What a sceptic accepts, and so what this computes:

* **target**: torch DDP's *mean* final held-out loss over its seeds;
* a method's **mean curve**: at each evaluated step every seed has, the mean held-out
  loss and the mean training time (step times summed, evaluations not counted);
* a method **reaches** the target at the first step whose mean loss is within
  ``TOLERANCE`` of it and that is one model on every seed (always for exact methods,
  only at syncs and at the end for local updates); its time to target is the mean
  curve's training time there;
* its **final loss** as mean, sample standard deviation and range over seeds, beside
  DDP's; "within DDP's spread" means the method's mean final lies inside the range of
  DDP's finals, widened by the reaching tolerance (with 3 seeds a standard deviation
  is itself noisy; the range is what was seen);
* **bound**: DDP's steps to the target at the no-sync run's median step time (the
  median over its seeds): what a method with free communication would need;
* **per step**: the median step time (the median of every seed's median), against
  torch DDP's and gradsync exact's;
* **bytes**: what the method's formula says a rank sends per step, beside what was
  measured crossing the link between the hosts (the interface counters, both
  directions, headers included), both means over seeds; "bytes vs DDP" is DDP's
  measured link bytes per step over the method's.

``slow_link.py``'s docstring says how the runs are made.
"""

from __future__ import annotations

import statistics

from slow_link_methods import LOCAL, SAMPLES_X

TOLERANCE = 1e-3
"""A mean evaluation within 0.1% of the target reaches it (exact methods' float32 sums
differ from DDP's in the last bits)."""

ANCHOR, BOUND, EXACT = "torch-ddp", "no-sync", "exact"


def summarise(rows: list[dict], link_rows: list[dict] | None = None) -> dict:
    """One run's figures from its metrics.jsonl rows (and the link counters, if read):
    the held-out curve as (step, training time so far, loss), per-step medians, bytes."""
    train_t, curve = 0.0, []
    for r in rows:
        train_t += r["step_time_s"]
        if r.get("eval_loss") is not None:
            curve.append((r["step"], train_t, r["eval_loss"]))
    steady = [r["step_time_s"] for r in rows[2:-1]] or [r["step_time_s"] for r in rows]
    sent = [r.get("sent_bytes") or 0 for r in rows]
    recorded = any(r.get("one_model") is not None for r in rows)
    return {"curve": curve,
            "one_model_steps": [r["step"] for r in rows if r.get("one_model")] if recorded
            else None, "steps": len(rows), "median_step_s": statistics.median(steady),
            "train_s": train_t, "sent_bytes_per_step": sum(sent) / max(1, len(sent)),
            "link_bytes_per_step": link_per_step(link_rows),
            "final_eval": curve[-1][2] if curve else None}


def link_per_step(link_rows: list[dict] | None) -> float | None:
    """Mean bytes that crossed the link per step, from counters read after every step:
    the differences from the first step's reading on (start-up, the parameter broadcast
    and the first step's bucket rebuild are left out)."""
    if not link_rows or link_rows[-1]["step"] <= link_rows[0]["step"]:
        return None
    first, last = link_rows[0], link_rows[-1]
    total = (last["tx"] + last["rx"]) - (first["tx"] + first["rx"])
    return total / (last["step"] - first["step"])


def comparable(method: str, step: int, last: int, quick_h: dict, runs: dict | None = None
               ) -> bool:
    """Is the model at ``step`` one model (every replica identical) on every seed?

    Local updates record it per step (``one_model`` in metrics.jsonl: after a sync or a
    synchronous warm-up step), which also covers a warm-up and a growing interval;
    runs without the record fall back to multiples of the method's H."""
    if method not in LOCAL or step == last:
        return True
    recorded = [r.get("one_model_steps") for r in (runs or {}).values()]
    if recorded and all(x is not None for x in recorded):
        return all(step in x for x in recorded)
    h = quick_h.get(method, LOCAL[method])
    return h is not None and step % h == 0


def mean_curve(runs: dict) -> list[tuple[int, float, float, float]]:
    """(step, mean training time, mean loss, loss std) at the steps every seed evaluated."""
    curves = [{s: (t, loss) for s, t, loss in run["curve"]} for run in runs.values()]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    out = []
    for s in common:
        ts, losses = zip(*(c[s] for c in curves))
        out.append((s, statistics.fmean(ts), statistics.fmean(losses), _std(losses)))
    return out


def _std(xs) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _finals(runs: dict) -> list[float]:
    return [r["final_eval"] for r in runs.values() if r.get("final_eval") is not None]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def reach(method: str, runs: dict, target: float, quick_h: dict):
    """(step, mean training time) where the mean curve first reaches the target, or
    (None, None)."""
    last = min(r["steps"] for r in runs.values())
    for step, t, loss, _ in mean_curve(runs):
        if loss <= target * (1 + TOLERANCE) and comparable(method, step, last, quick_h, runs):
            return step, t
    return None, None


def judge(results: dict, workload: str, rate: str, quick_h: dict) -> list[dict]:
    """The table's rows for one (workload, rate), every method over its seeds.

    ``results[workload][rate][method][seed]`` is one run's :func:`summarise`.
    """
    by_method = {m: seeds for m, seeds in results.get(workload, {}).get(rate, {}).items()
                 if seeds}
    anchor = by_method.get(ANCHOR)
    anchor_finals = _finals(anchor) if anchor else []
    if not anchor_finals:
        return []
    target = statistics.fmean(anchor_finals)
    lo, hi = min(anchor_finals), max(anchor_finals)
    slack = TOLERANCE * target  # as for reaching: an exact method's last bits differ
    anchor_step, anchor_t = reach(ANCHOR, anchor, target, quick_h)

    def median_step(runs):
        return statistics.median(r["median_step_s"] for r in runs.values())

    bound_t = (anchor_step * median_step(by_method[BOUND])
               if BOUND in by_method and anchor_step else None)
    anchor_step_s = median_step(anchor)
    exact_step_s = median_step(by_method[EXACT]) if EXACT in by_method else None
    anchor_link = _mean(r.get("link_bytes_per_step") for r in anchor.values())
    rows = []
    for method, runs in by_method.items():
        step, t = reach(method, runs, target, quick_h) if method != BOUND else (None, None)
        finals = _finals(runs)
        final = statistics.fmean(finals) if finals else None
        link = _mean(r.get("link_bytes_per_step") for r in runs.values())
        step_s = median_step(runs)
        label = f"{method} ({SAMPLES_X[method]}x samples)" if method in SAMPLES_X else method
        rows.append({
            "method": label, "seeds": sorted(runs, key=str), "target": target,
            "target_std": _std(anchor_finals), "target_range": (lo, hi),
            "steps_to_target": step, "time_to_target_s": t,
            "speedup_vs_ddp": anchor_t / t if t and anchor_t else None,
            "fraction_of_bound": bound_t / t if t and bound_t else None, "bound_s": bound_t,
            "median_step_s": step_s, "per_step_vs_ddp": anchor_step_s / step_s,
            "per_step_vs_exact": exact_step_s / step_s if exact_step_s else None,
            "sent_mb_per_step": _mean(r["sent_bytes_per_step"] for r in runs.values()) / 1e6,
            "link_mb_per_step": link / 1e6 if link is not None else None,
            "bytes_vs_ddp": anchor_link / link if link and anchor_link else None,
            "final_eval": final, "final_std": _std(finals) if finals else None,
            "final_range": (min(finals), max(finals)) if finals else None,
            "final_vs_target": final / target - 1 if final is not None else None,
            "within_ddp_spread": (lo - slack <= final <= hi + slack
                                  if final is not None else None),
            "curve": mean_curve(runs),
        })
    return rows
