"""Tables and the fit picture for ``gradsync calibrate`` (calibration itself never renders).

The fit table puts the quality figures (R², worst relative residual) next to
alpha and beta so a poor fit -- a noisy machine, a protocol switch between small
and large messages -- is seen before the numbers feed the simulator. The PNG
shows the measured medians and the fitted line per collective on log-log axes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from ..plan.units import fmt_bytes, fmt_time
from .plan_plots import _plt, _save

if TYPE_CHECKING:
    from ..calibrate import BackwardTiming, Calibration, CollectiveCalibration


def fit_table(coll: CollectiveCalibration) -> Table:
    t = Table(title=f"Collectives on {coll.world_size} workers: t = alpha + bytes / bandwidth "
                    f"(median of {coll.reps} reps per size, relative least squares)")
    for col in ("collective", "sizes", "alpha", "bandwidth", "R²", "max |resid|/t",
                "at largest"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for op in coll.ops.values():
        f = op.fit
        sizes = f"{fmt_bytes(op.nbytes[0])}..{fmt_bytes(op.nbytes[-1])} ({len(op.nbytes)})"
        t.add_row(op.op, sizes,
                  fmt_time(f.alpha_s), f"{f.bandwidth / 1e9:.2f} GB/s", f"{f.r2:.3f}",
                  f"{100 * f.max_rel_residual:.0f}%", fmt_time(op.median_s[-1]))
    return t


def backward_table(cal: Calibration, top: int = 5) -> Table:
    s, c, prof = cal.single, cal.contended, cal.profile
    from rich.text import Text  # a plain Text: "pm:llama:" is a name, not an emoji code

    t = Table(title=Text(f"{cal.spec}: {len(prof.params)} parameters, "
                         f"{fmt_bytes(sum(p.numel * p.itemsize for p in prof.params))} "
                         "of gradients", style="italic"))
    for col in ("", "forward", "backward", "optimizer", "step (no comm)"):
        t.add_column(col, justify="left" if not col else "right")

    def row(label: str, b: BackwardTiming) -> None:
        t.add_row(label, fmt_time(b.forward_s), fmt_time(b.backward_s), fmt_time(b.optimizer_s),
                  fmt_time(b.forward_s + b.backward_s + b.optimizer_s))

    row("one process alone", s)
    row(f"{c.workers} workers at once (profile)", c)
    o = cal.overlap
    where = "in the profile" if cal.overlap_in_profile else "not in the profile (--free-overlap)"
    t.caption = (
        f"co-running slowdown of backward {cal.corun_slowdown:.2f}x. Overlap penalties: "
        f"backward runs at {1 - o.compute:.0%} speed while an all-reduce is in flight "
        f"(f = {o.compute:.2f}), an all-reduce at {1 - o.comm:.0%} while backward computes "
        f"(g = {o.comm:.2f}); "
        f"{where}. Longest gaps between gradients (charged to the first "
        "parameter of each layer to arrive): " + ", ".join(
            f"{p.name} {fmt_time(p.backward_s)}"
            for p in sorted(prof.params, key=lambda p: -p.backward_s)[:top]))
    return t


def fit_png(coll: CollectiveCalibration, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in coll.ops.values():
        (line,) = ax.plot(op.nbytes, [1e3 * m for m in op.median_s], "o", label=f"{op.op} measured")
        lo, hi = op.nbytes[0], op.nbytes[-1]
        xs = [lo * (hi / lo) ** (k / 50) for k in range(51)]
        ax.plot(xs, [1e3 * op.fit.predict(x) for x in xs], "-", color=line.get_color(),
                label=f"{op.op} fit: {1e3 * op.fit.alpha_s:.2f} ms + B / "
                      f"{op.fit.bandwidth / 1e9:.2f} GB/s (R² {op.fit.r2:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size, bytes")
    ax.set_ylabel("time, ms (median)")
    ax.set_title(f"gradsync calibrate: collectives on {coll.world_size} workers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    plt.close(fig)
