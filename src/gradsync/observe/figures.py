"""The report's figures as PNG bytes (matplotlib, Agg: no display, no network), each with
the caption of what it shows.

Rendering only: every number comes from RunData/StepTimeline, computed
elsewhere. A figure whose data is missing is simply not drawn (the page says
what is missing), and a caption is built next to the drawing, sentence by
drawn line, so it never describes a line that is not there. Every figure over
steps carries the run's resume points and worker counts (``step_marks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .balance_view import CAPTION as BALANCE_CAPTION  # noqa: E402
from .balance_view import balance_figure  # noqa: E402
from .figures_run import COLORS, comm_figure, memory_figure, png, timeline_figure  # noqa: E402
from .ft_view import FIGURE as FT_FIGURE  # noqa: E402
from .ft_view import ft_figure  # noqa: E402
from .run_data import RunData  # noqa: E402
from .step_marks import StepMarks  # noqa: E402
from .sync_mode import LOCAL, sync_mode  # noqa: E402
from .timeline import StepTimeline  # noqa: E402


@dataclass
class Figure:
    png: bytes
    caption: str


def series(run: RunData, key: str):
    pts = [(m["step"], m[key]) for m in run.metrics if m.get(key) is not None and "step" in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8])) + (f" and {len(steps) - 8} more" if len(steps) > 8
                                              else "")
    return f"step{'s' * (len(steps) > 1)} {shown}"


def _held_out(ax, run: RunData, ex: list[int], ey: list[float]) -> str:
    """Draw the held-out loss; its caption, from what each evaluated step held.

    ``evaluate`` sums the held-out items' losses over the ranks, each rank scoring its
    share of the set on the model it holds. That is one model's loss, exact over the
    whole set, wherever the replicas are identical: every step of an exact or
    compressed run, and a local-update step that ended in a sync (``one_model`` in
    metrics.jsonl). Between syncs each worker scores its own replica on its share, and
    the figure is the mean of those scores, no model's loss: those points are drawn
    hollow and said apart (issue 37: the caption called them exact).
    """
    mixed = {m["step"] for m in run.metrics if "step" in m and m.get("one_model") is False}
    one = [(s, v) for s, v in zip(ex, ey) if s not in mixed]
    apart = [(s, v) for s, v in zip(ex, ey) if s in mixed]
    ax.plot(ex, ey, "-", color="#e45756", lw=1, alpha=0.6)
    text = ""
    if one:
        ax.plot([s for s, _ in one], [v for _, v in one], "o", ms=4, color="#e45756",
                label="held-out (one model)")
        where = (f" (the one model every worker holds after a sync: "
                 f"{_steps_text([s for s, _ in one])})" if sync_mode(run.config) == LOCAL else "")
        text += f" Red dots: the held-out loss, exact over the whole held-out set{where}."
    if apart:
        ax.plot([s for s, _ in apart], [v for _, v in apart], "o", ms=5, mfc="white",
                color="#e45756", label="held-out (each worker its replica)")
        text += (f" Hollow red circles ({_steps_text([s for s, _ in apart])}, between syncs): "
                 "each worker scores its own replica on its share of the held-out set, and "
                 "the point is the mean of those scores over the whole set, not one model's "
                 "loss.")
    return text


def loss_figure(run: RunData):
    """Loss per step (and the held-out loss), the gradient norm and the learning rate below."""
    x, y = series(run, "loss")
    if not x:
        return None
    local = sync_mode(run.config) == LOCAL
    ex, ey = series(run, "eval_loss")
    gx, gy = series(run, "grad_norm")
    lx, ly = series(run, "lr")
    fig, (ax, gax, lax) = plt.subplots(3, 1, figsize=(6.4, 5.6), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1.3, 1]})
    ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label="training (global batch)")
    text = ("Loss: the mean over every item of the global batch, per step"
            + (", each item's loss taken on its own worker's replica." if local else
               " (exact: summed over ranks and micro-steps, divided by the item count)."))
    if ex:
        text += _held_out(ax, run, ex, ey)
    ax.set(ylabel="loss (mean over items)", title="Loss")
    ax.legend(fontsize=8)
    if gx:
        gax.plot(gx, gy, color="#b279a2", marker="o" if len(gx) < 30 else None, ms=3)
        text += (" Middle: the gradient norm each step, before clipping ("
                 + ("rank 0's local gradient: workers do not share gradients between syncs"
                    if local else "of the synchronised gradient every rank applies") + ").")
    gax.set(ylabel="gradient norm")
    if lx:
        lax.plot(lx, ly, color="#54a24b")
        text += " Bottom: the learning rate each step used."
    lax.set(xlabel="step", ylabel="learning rate")
    lax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for a in (ax, gax, lax):
        a.grid(alpha=0.3)
    return fig, text


def throughput_figure(run: RunData, marks: StepMarks):
    x, y = series(run, "samples_per_s")
    if not x:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label="measured")
    text = "Throughput per step: samples of the global batch per second of step time."
    base = (run.baseline or {}).get("samples_per_s")
    if base:
        for i, s in enumerate(marks.segments):  # K times the baseline, K of each stretch
            ax.hlines(s.world_size * base, s.first - 0.5, s.last + 0.5, ls="--", color="gray",
                      label="workers x the 1-worker baseline" if i == 0 else None)
        text += (" Dashed: the worker count times the 1-worker baseline's rate (--baseline), "
                 "perfect scaling.")
    ax.set(xlabel="step", ylabel="samples / s", title="Throughput")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig, text


def breakdown_figure(run: RunData):
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
    return fig, ("Rank 0's step time split into compute (communication hidden behind "
                 "backward counts here) and exposed communication: time blocked waiting on "
                 "collectives.")


def make_figures(run: RunData, measured: StepTimeline | None,
                 predicted: StepTimeline | None) -> dict[str, Figure]:
    """{file name: Figure} for every figure whose data exists, in page order."""
    marks = StepMarks(run.metrics, run.events)
    out: dict[str, Figure] = {}

    def balance_png(fig) -> bytes:  # balance_view draws it; the marks are added here
        marks.mark("balance.png", fig)
        return png(fig)

    drawn = (("loss.png", loss_figure(run)), ("throughput.png", throughput_figure(run, marks)),
             ("step_breakdown.png", breakdown_figure(run)))
    for name, made in drawn:
        if made is not None:
            marks.mark(name, made[0])
            out[name] = Figure(png(made[0]), made[1] + marks.caption(name))
    balance = balance_figure(run, balance_png)
    if balance is not None:
        out["balance.png"] = Figure(balance, BALANCE_CAPTION + marks.caption("balance.png"))
    comm = comm_figure(run)
    if comm is not None:
        marks.mark("communication.png", comm[0])
        out["communication.png"] = Figure(png(comm[0]),
                                          comm[1] + marks.caption("communication.png"))
    ft = ft_figure(run)  # drawn in its own section of the page, as the timeline is
    if ft is not None:
        marks.mark(FT_FIGURE, ft[0])
        out[FT_FIGURE] = Figure(png(ft[0]), ft[1] + marks.caption(FT_FIGURE))
    timeline = timeline_figure(measured, predicted)
    if timeline is not None:
        out["timeline.png"] = Figure(*timeline)
    memory = memory_figure(run)
    if memory is not None:
        out["memory.png"] = Figure(png(memory[0]), memory[1])
    return out
