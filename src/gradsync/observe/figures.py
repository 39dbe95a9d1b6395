"""The report's figures as PNG bytes (matplotlib, Agg: no display, no network).

Rendering only: every number comes from RunData/StepTimeline, computed
elsewhere. A figure whose data is missing is simply not drawn; the page says
what is missing.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .balance_view import balance_figure  # noqa: E402
from .run_data import RunData  # noqa: E402
from .timeline import StepTimeline  # noqa: E402

COLORS = {"forward": "#4c78a8", "backward": "#72b7b2", "optimizer": "#b279a2",
          "sync wait": "#e45756", "comm": "#f58518", "other collective": "#ffbf79",
          "other": "#9d9d9d"}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _series(run: RunData, key: str):
    pts = [(m["step"], m[key]) for m in run.metrics if m.get(key) is not None and "step" in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_figure(run: RunData) -> bytes | None:
    """Loss per step (and the held-out loss where evaluated), the learning rate below."""
    x, y = _series(run, "loss")
    if not x:
        return None
    ex, ey = _series(run, "eval_loss")
    lx, ly = _series(run, "lr")
    fig, (ax, lax) = plt.subplots(2, 1, figsize=(6.4, 4.4), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.2]})
    ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label="training (global batch)")
    if ex:
        ax.plot(ex, ey, "o-", ms=4, color="#e45756", label="held-out")
    ax.set(ylabel="loss (mean over items)", title="Loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if lx:
        lax.plot(lx, ly, color="#54a24b")
    lax.set(xlabel="step", ylabel="learning rate")
    lax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lax.grid(alpha=0.3)
    return _png(fig)


def throughput_figure(run: RunData) -> bytes | None:
    x, y = _series(run, "samples_per_s")
    if not x:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label=f"{run.world_size} workers")
    if run.baseline and run.baseline.get("samples_per_s"):
        ideal = run.world_size * run.baseline["samples_per_s"]
        ax.axhline(ideal, ls="--", color="gray", label="linear scaling of the 1-worker baseline")
    ax.set(xlabel="step", ylabel="samples / s", title="Throughput")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def breakdown_figure(run: RunData) -> bytes | None:
    rows = [m for m in run.metrics if "compute_s" in m and "exposed_comm_s" in m]
    if not rows:
        return None
    steps = [m["step"] for m in rows]
    compute = [m["compute_s"] * 1e3 for m in rows]
    exposed = [m["exposed_comm_s"] * 1e3 for m in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.bar(steps, compute, color=COLORS["backward"], label="compute (incl. hidden comm)")
    ax.bar(steps, exposed, bottom=compute, color=COLORS["sync wait"],
           label="exposed communication (blocked)")
    ax.set(xlabel="step", ylabel="ms", title="Step time breakdown (rank 0)")
    ax.legend(fontsize=8)
    return _png(fig)


def communication_figure(run: RunData) -> bytes | None:
    """Bytes communicated per step and, for compressed gradients, the distance from exact.

    ``sent_bytes`` (what this rank put on the wire, counted by a compressing or
    local-update strategy) when the run has it, else ``comm_bytes`` (the tensors
    handed to collectives). Probed steps add the compressed gradient's cosine with
    the exact one and its relative error.
    """
    key = "sent_bytes" if any(m.get("sent_bytes") is not None for m in run.metrics) \
        else "comm_bytes"
    x, y = _series(run, key)
    if not x:
        return None
    cx, cy = _series(run, "grad_cosine")
    rx, ry = _series(run, "grad_rel_error")
    rows = 2 if cx else 1
    fig, axes = plt.subplots(rows, 1, figsize=(6.4, 2.6 * rows + 0.4), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    ax.bar(x, [v / 2**20 for v in y], color=COLORS["forward"])
    ax.set(ylabel="MiB per step (rank 0)",
           title="Communication: " + ("bytes on the wire" if key == "sent_bytes"
                                      else "bytes handed to collectives"))
    ax.grid(alpha=0.3)
    if cx:
        dax = axes[1][0]
        dax.plot(cx, cy, "o-", ms=3, label="cosine with the exact gradient")
        dax.plot(rx, ry, "s-", ms=3, color="#e45756", label="relative error")
        dax.set(xlabel="step", ylabel="distance from exact")
        dax.legend(fontsize=8)
        dax.grid(alpha=0.3)
    else:
        ax.set(xlabel="step")
    return _png(fig)


def memory_figure(run: RunData) -> bytes | None:
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
    for i, v in enumerate(peaks):
        ax.text(i, v, f"{v:,.0f} MiB", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="peak memory (MiB)",
           title="Peak memory per rank (whole process on CPU, allocator peak on GPU)")
    return _png(fig)


def _color(name: str, cat: str) -> str:
    if cat == "comm":
        return COLORS["comm"] if "bucket" in name else COLORS["other collective"]
    return COLORS.get(name, COLORS["other"])


def timeline_figure(measured: StepTimeline | None, predicted: StepTimeline | None) -> bytes | None:
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
    return _png(fig)


def make_figures(run: RunData, measured: StepTimeline | None,
                 predicted: StepTimeline | None) -> dict[str, bytes]:
    """{file name: PNG bytes} for every figure whose data exists, in page order."""
    out = {}
    for name, png in (("loss.png", loss_figure(run)),
                      ("throughput.png", throughput_figure(run)),
                      ("step_breakdown.png", breakdown_figure(run)),
                      ("balance.png", balance_figure(run, _png)),
                      ("communication.png", communication_figure(run)),
                      ("timeline.png", timeline_figure(measured, predicted)),
                      ("memory.png", memory_figure(run))):
        if png is not None:
            out[name] = png
    return out
