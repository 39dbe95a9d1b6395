"""The report's figures about communication, one traced step and memory, with captions.

Split from ``figures.py`` (the training curves) to keep each file about one
thing; the same rules hold: a missing figure is not drawn, and a caption says
only what is drawn.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .run_data import RunData  # noqa: E402
from .timeline import StepTimeline  # noqa: E402
from .traffic import exact_step_bytes, gradient_bytes  # noqa: E402

COLORS = {"forward": "#4c78a8", "backward": "#72b7b2", "optimizer": "#b279a2",
          "sync wait": "#e45756", "comm": "#f58518", "other collective": "#ffbf79",
          "other": "#9d9d9d"}


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _points(run: RunData, key: str):
    pts = [(m["step"], m[key]) for m in run.metrics if m.get(key) is not None and "step" in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def comm_figure(run: RunData):
    """Bytes per step next to the exact all-reduce's; compressed runs: the distance from exact.

    ``sent_bytes`` (what rank 0 put on the wire, counted by the strategy) when the
    run has it, else ``comm_bytes`` (the tensors handed to collectives). Probed
    steps add the compressed gradient's cosine with the exact one and its relative
    error. Returns (matplotlib figure, caption) or None.
    """
    key = "sent_bytes" if any(m.get("sent_bytes") is not None for m in run.metrics) \
        else "comm_bytes"
    x, y = _points(run, key)
    if not x:
        return None
    cx, cy = _points(run, "grad_cosine")
    rx, ry = _points(run, "grad_rel_error")
    rows = 2 if cx or rx else 1
    fig, axes = plt.subplots(rows, 1, figsize=(6.4, 2.6 * rows + 0.4), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    ax.bar(x, [v / 2**10 for v in y], color=COLORS["forward"], label="sent")
    text = ("Bars: the bytes rank 0 put on the wire each step, as the strategy counts them."
            if key == "sent_bytes" else "Bars: the bytes rank 0 handed to collectives each "
            "step (this strategy does not count bytes on the wire).")
    sizes = gradient_bytes(run.summary, run.plan)
    if key == "sent_bytes" and sizes is not None:
        ex = [m["step"] for m in run.metrics if m.get(key) is not None]
        ey = [exact_step_bytes(sizes, int(m.get("world_size") or 1)) / 2**10
              for m in run.metrics if m.get(key) is not None]
        # a line, stepped at each step: ticks ran together into one over many steps, and the
        # caption said "ticks" for it (issue 37); a stepped line reads alike at any length
        ax.plot(ex, ey, "-", drawstyle="steps-mid", lw=1.5, color="#e45756",
                label="exact all-reduce")
        text += (" Red line: what the exact all-reduce of the same gradients would send on "
                 "each step.")
        ax.legend(fontsize=8)
    ax.set(ylabel="KiB per step (rank 0)",
           title="Communication: " + ("bytes on the wire" if key == "sent_bytes"
                                      else "bytes handed to collectives"))
    ax.grid(alpha=0.3)
    if rows == 2:  # cosine near 1, relative error near 0: one axis each
        dax = axes[1][0]
        dax.set(xlabel="step")
        dax.grid(alpha=0.3)
        if cx:
            dax.plot(cx, cy, "o-", ms=3, label="cosine with the exact gradient (left)")
            dax.set_ylabel("cosine")
            text += (" Below, on probed steps (--probe-every): the cosine between the "
                     "compressed and the exact gradient (left axis)")
        if rx:
            eax = dax.twinx() if cx else dax
            eax.plot(rx, ry, "s-", ms=3, color="#e45756", label="relative error (right)")
            eax.set_ylabel("relative error")
            text += (" and" if cx else " Below, on probed steps (--probe-every):") + \
                " the relative error |compressed - exact| / |exact|" + \
                (" (right axis)" if cx else "")
        text += "."
        handles = [h for a in dax.figure.axes[1:] for h in a.get_lines() if h.get_label()
                   and not h.get_label().startswith("_")]
        dax.legend(handles, [h.get_label() for h in handles], fontsize=8)
    else:
        ax.set(xlabel="step")
    return fig, text


def memory_figure(run: RunData):
    """Peak memory per rank, each bar labelled: (matplotlib figure, caption) or None."""
    peaks: list[float] = []
    for m in run.metrics:
        for r, v in enumerate(m.get("peak_mem_mb_by_rank") or []):
            if r >= len(peaks):
                peaks.append(v)
            peaks[r] = max(peaks[r], v)
    if not peaks:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    ranks = [f"rank {r}" for r in range(len(peaks))]
    ax.bar(ranks, peaks, color=COLORS["forward"])
    top = max(peaks) or 1.0
    for i, v in enumerate(peaks):  # inside a bar's top (above a short one): labels above the
        inside = v > 0.25 * top    # tallest bar ran across the frame and the title (issue 37)
        ax.annotate(f"{v:,.0f} MiB", (i, v), xytext=(0, -3 if inside else 3),
                    textcoords="offset points", ha="center", va="top" if inside else "bottom",
                    fontsize=8, color="white" if inside else "black")
    ax.set_ylim(0, top * 1.08)
    ax.set(ylabel="peak memory (MiB)",
           title="Peak memory per rank (whole process on CPU, allocator peak on GPU)")
    return fig, "Peak memory per rank over the run, each bar labelled with its value."


def _color(name: str, cat: str) -> str:
    if cat == "comm":
        return COLORS["comm"] if "bucket" in name else COLORS["other collective"]
    return COLORS.get(name, COLORS["other"])


def timeline_figure(measured: StepTimeline | None,
                    predicted: StepTimeline | None) -> tuple[bytes, str] | None:
    parts = [t for t in (measured, predicted) if t is not None]
    if not parts:
        return None
    n = sum(len(t.lanes) for t in parts)
    fig, axes = plt.subplots(len(parts), 1, figsize=(9, 0.55 * n + 1.4 * len(parts)),
                             sharex=True, squeeze=False)
    xmax = max(t.step_s for t in parts) * 1e3
    for ax, t in zip(axes[:, 0], parts):
        for row, lane in enumerate(reversed(t.lanes)):
            for start, end, name, cat in lane.spans:
                ax.broken_barh([(start * 1e3, max(end - start, 1e-6) * 1e3)], (row + 0.1, 0.8),
                               facecolors=_color(name, cat), edgecolor="white", linewidth=0.4)
        ax.set_yticks([r + 0.5 for r in range(len(t.lanes))],
                      [lane.label for lane in reversed(t.lanes)], fontsize=8)
        ax.set_title(f"{t.title} ({t.step_s * 1e3:.1f} ms)", fontsize=9, loc="left")
        ax.set_xlim(0, xmax * 1.02)
    axes[-1, 0].set_xlabel("ms from the start of the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    labels = [("bucket all-reduce" if k == "comm" else k) for k in COLORS]
    fig.legend(handles, labels, loc="lower center", ncol=7, fontsize=8,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    text = "One traced step" if measured is None else f"Traced step {measured.step}"
    text += ", every rank, as --trace recorded it (trace.json)"
    if predicted is not None:
        text += ", next to the simulator's prediction for the same bucket plan"
    return png(fig), text + "."
