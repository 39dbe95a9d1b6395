"""The report's view of straggler balancing: each rank's share and speed, and the time saved.

Everything here reads ``metrics.jsonl`` fields the training loop writes on every
step (``share_by_rank``, ``busy_s_by_rank``, ``step_time_s``); a run from
before balancing existed has none of them and gets neither figure nor row.

The time saved is measured, not modelled: each uneven step's time against the median
time of the even-split steps just before the first change (the steps the balancer
measured the straggler on), from ``step_time_s``. metrics.jsonl's ``balance_saved_s``
is the balancer's own prediction from its speed model; the report no longer says it as
a saving (issue 37).
"""

from __future__ import annotations

import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .run_data import RunData  # noqa: E402

CAPTION = ("Straggler balancing (--balance auto): top, the samples each rank took per step "
           "(they sum to the global batch; the update is the exact mean either way); "
           "middle, each rank's own speed, samples per second of compute (step time minus "
           "time blocked on collectives); bottom, the milliseconds each uneven step took less "
           "than the median even-split step just before the first change (measured step "
           "times).")

BASELINE = 5  # even-split steps before the first change that the saving is measured against


def measured_saving(metrics: list[dict]) -> dict | None:
    """What the uneven split saved, from the steps' own times: ``baseline_s`` (median
    ``step_time_s`` of the last :data:`BASELINE` even-split steps before the first uneven
    one, step 1 left out), ``baseline_steps``, ``uneven`` (step, seconds saved) for each
    uneven step, ``saved_s`` their sum, ``uneven_median_s``. None: no uneven step, or no
    even-split step before it to measure against."""
    rows = [m for m in metrics if m.get("share_by_rank") and m.get("step_time_s")]
    first = next((i for i, m in enumerate(rows) if len(set(m["share_by_rank"])) > 1), None)
    if first is None:
        return None
    before = [m for m in rows[:first] if m["step"] > 1][-BASELINE:]
    if not before:
        return None
    base = statistics.median(m["step_time_s"] for m in before)
    uneven = [(m["step"], base - m["step_time_s"]) for m in rows
              if len(set(m["share_by_rank"])) > 1]
    return {"baseline_s": base, "baseline_steps": [m["step"] for m in before],
            "uneven": uneven, "saved_s": sum(v for _, v in uneven),
            "uneven_median_s": statistics.median(m["step_time_s"] for m in rows
                                                 if len(set(m["share_by_rank"])) > 1)}


def saving_text(saving: dict | None) -> str:
    """The measured saving in words (the report's row and the terminal table's)."""
    if saving is None:
        return "saving not measured (no even-split step before the first change)"
    b = saving["baseline_steps"]
    n = len(saving["uneven"])
    return (f"saved {saving['saved_s']:.2f} s over {n} uneven step{'s' * (n != 1)} "
            f"(measured: median step {1e3 * saving['uneven_median_s']:.1f} ms against "
            f"{1e3 * saving['baseline_s']:.1f} ms on the even split, steps {b[0]}-{b[-1]})")


def _rows(run: RunData) -> list[dict]:
    return [m for m in run.metrics if m.get("share_by_rank") and m.get("busy_s_by_rank")]


def balance_figure(run: RunData, png) -> bytes | None:
    """Shares, speeds and savings per step; None when no step recorded shares."""
    rows = _rows(run)
    if not rows or not any(len(set(m["share_by_rank"])) > 1 for m in rows):
        return None  # always the even split: nothing to show beyond the step table
    steps = [m["step"] for m in rows]
    world = max(len(m["share_by_rank"]) for m in rows)
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(6.4, 6.4), sharex=True)
    bottom = [0] * len(rows)
    for r in range(world):
        share = [m["share_by_rank"][r] if r < len(m["share_by_rank"]) else 0 for m in rows]
        top.bar(steps, share, bottom=bottom, width=1.0, label=f"rank {r}")
        bottom = [b + s for b, s in zip(bottom, share)]
        speed = [m["share_by_rank"][r] / m["busy_s_by_rank"][r]
                 if r < len(m["busy_s_by_rank"]) and m["busy_s_by_rank"][r] > 0 else None
                 for m in rows]
        mid.plot(steps, speed, label=f"rank {r}")
    top.set(ylabel="samples", title="Each rank's share of the global batch")
    top.legend(fontsize=7, ncol=min(world, 4))
    mid.set(ylabel="samples / s (compute)")
    mid.set_ylim(bottom=0)
    saving = measured_saving(run.metrics)
    saved = [(s, v * 1e3) for s, v in saving["uneven"]] if saving else []
    if saved:
        low.bar([s for s, _ in saved], [v for _, v in saved], width=1.0, color="#54a24b")
    low.axhline(0, color="gray", lw=0.5)
    low.set(xlabel="step", ylabel="ms saved / step")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
    return png(fig)


def balance_rows(run: RunData) -> list[tuple[str, str]]:
    """Key-number rows: what balancing did over the run, or why it was off."""
    cfg, rows = run.config, _rows(run)
    mode = cfg.get("balance")
    if mode is None:
        return []
    if mode == "off":
        return [("straggler balancing", "off (--balance off): every rank took an even share")]
    if cfg.get("sync", "exact") != "exact" or cfg.get("compress", "none") != "none":
        return [("straggler balancing", "off: only with --sync exact and no --compress")]
    uneven = [m for m in rows if len(set(m["share_by_rank"])) > 1]
    if not uneven:
        return [("straggler balancing", "on; no rank was measured slower: even split "
                                        "throughout")]
    last = uneven[-1]["share_by_rank"]
    return [("straggler balancing",
             f"uneven split on {len(uneven)} of {len(rows)} steps (last: "
             f"{' / '.join(map(str, last))} samples); "
             f"{saving_text(measured_saving(run.metrics))}")]
