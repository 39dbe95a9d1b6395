"""Matplotlib PNGs of the planner's results (Agg backend: no display needed).

matplotlib is an optional dependency (the ``plot`` extra); asking for a PNG
without it is a one-line UsageError, not a traceback.
"""

from __future__ import annotations

from ..errors import UsageError
from ..plan.comm import CommPlan
from ..plan.memory import MemoryPlan
from ..plan.simulate import StepResult, Sweep
from ..plan.two_level import ALGORITHMS, TwoLevelPlan
from ..plan.units import fmt_bytes
from ..rundir import write_bytes


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("PNG output needs matplotlib: pip install 'gradsync[plot]'") from None
    return plt


def _save(fig, path: str) -> None:
    """Rendered in memory, then written atomically (StorageError names the file)."""
    import io

    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        write_bytes(path, buf.getvalue(), "the plot")
    finally:
        fig.clf()
        import matplotlib.pyplot as plt

        plt.close(fig)


def memory_png(plan: MemoryPlan, path: str) -> None:
    """Stacked bars per strategy; the device capacity as a horizontal line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [s.stage for s in plan.stages]
    bottom = [0.0] * len(names)
    for part, color in (("params", "#4c78a8"), ("grads", "#f58518"),
                        ("optimizer", "#54a24b"), ("activations", "#b279a2")):
        vals = [(getattr(s, part) or 0.0) / 1e9 for s in plan.stages]  # None: not estimated
        if any(vals):
            ax.bar(names, vals, bottom=bottom, label=part, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if plan.device_memory is not None:
        ax.axhline(plan.device_memory / 1e9, color="red", ls="--", label="device memory")
    ax.set_ylabel("GB per device (1e9 B)")
    unknown = ", activations not estimated" if plan.activations is None else ""
    ax.set_title(f"P = {plan.num_params:,}, N = {plan.world_size}, {plan.precision}, "
                 f"{plan.optimizer}{unknown}")
    ax.legend()
    _save(fig, path)


def comm_png(plan: CommPlan, path: str) -> None:
    """Time per step of each pattern against worker count (log-log)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ns = [r.workers for r in plan.rows]
    series = [("ring all-reduce", "ring_s"), ("tree all-reduce", "tree_s"),
              ("parameter-server ingress", "ps_ingress_s"), ("ZeRO-3 (RS + 2 AG)", "zero3_s")]
    if plan.per_node:
        series.append(("hierarchical", "hierarchical_s"))
    for label, attr in series:
        pts = [(n, getattr(r, attr)) for n, r in zip(ns, plan.rows) if getattr(r, attr)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("seconds per step")
    ax.set_title(f"{plan.grad_bytes / 1e9:g} GB gradient, {plan.bandwidth / 1e9:g} GB/s links")
    ax.legend()
    _save(fig, path)


def two_level_png(plan: TwoLevelPlan, path: str) -> None:
    """Each algorithm's predicted all-reduce time against worker count (log-log)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ns = [r.workers for r in plan.rows]
    for k, name in enumerate(ALGORITHMS):
        ax.plot(ns, [r.costs[k].seconds for r in plan.rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("seconds per all-reduce")
    ax.set_title(f"{fmt_bytes(plan.nbytes)} gradient, hosts of {plan.ranks_per_host}, "
                 f"{plan.inter.bandwidth * 8 / 1e6:,.0f} Mbit/s between hosts")
    ax.legend()
    _save(fig, path)


def timeline_png(result: StepResult, path: str) -> None:
    """Compute lane (backward per parameter), comm lane (buckets), exposed comm shaded."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 2.8))
    fwd_start = result.last_backward_start_s - result.forward_s / result.accum_steps
    if fwd_start > 0:
        ax.broken_barh([(0, fwd_start)], (1.1, 0.8), color="#cccccc")
    ax.broken_barh([(fwd_start, result.last_backward_start_s - fwd_start)], (1.1, 0.8),
                   color="#9ecae1")
    for k, g in enumerate(result.grads):
        ax.broken_barh([(g.start_s, g.end_s - g.start_s)], (1.1, 0.8),
                       color="#3182bd" if k % 2 else "#6baed6")
    opt_start = result.step_s - result.optimizer_s
    if result.optimizer_s:
        ax.broken_barh([(opt_start, result.optimizer_s)], (1.1, 0.8), color="#31a354")
    for k, b in enumerate(result.buckets):
        ax.broken_barh([(b.start_s, b.end_s - b.start_s)], (0.1, 0.8),
                       color="#e6550d" if k % 2 else "#fd8d3c")
    if result.exposed_s > 0:
        ax.axvspan(result.backward_end_s, opt_start, color="red", alpha=0.15,
                   label=f"exposed comm {result.exposed_s * 1e3:.2f} ms")
        ax.legend(loc="upper left")
    ax.set_yticks([0.5, 1.5], ["comm", "compute"])
    ax.set_xlabel("seconds")
    ax.set_title(f"step {result.step_s * 1e3:.2f} ms, bucket cap {result.bucket_cap_mb:g} MB, "
                 f"efficiency {result.efficiency:.1%}")
    _save(fig, path)


def sweep_png(sweep: Sweep, path: str) -> None:
    """The valley: step time against bucket size, optimum and 25 MB default marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sweep.sizes_mb, [s * 1e3 for s in sweep.step_s], marker=".")
    ax.axvline(sweep.default_mb, color="grey", ls="--",
               label=f"default {sweep.default_mb:g} MB: {sweep.default_s * 1e3:.2f} ms")
    ax.plot([sweep.optimum_mb], [sweep.optimum_s * 1e3], "r*", ms=12,
            label=f"optimum {sweep.optimum_mb:.3g} MB: {sweep.optimum_s * 1e3:.2f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("bucket cap (MB, as DDP counts: MiB)")
    ax.set_ylabel("step time (ms)")
    ax.legend()
    _save(fig, path)
