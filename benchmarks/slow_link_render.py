"""The slow-link benchmark's output: Markdown and terminal tables, the loss-time picture.

Written after every run from ``results.json`` alone (``--render-only`` redraws
them), so this module only reads figures; ``slow_link_judge.py`` computes them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from slow_link_judge import judge
from slow_link_methods import LOCAL, METHODS


def _fmt(v, spec, none="-"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


COLUMNS = (  # header, row key, format, what None shows as
    ("method", "method", "s", "-"),
    ("time to target (s)", "time_to_target_s", ".1f", "not reached"),
    ("steps", "steps_to_target", "d", "-"),
    ("x torch DDP", "speedup_vs_ddp", ".2f", "-"),
    ("fraction of bound", "fraction_of_bound", ".2f", "-"),
    ("s/step", "median_step_s", ".3f", "-"),
    ("per step vs exact", "per_step_vs_exact", ".2f", "-"),
    ("MB sent/rank/step", "sent_mb_per_step", ".3f", "-"),
    ("link MB/step (measured)", "link_mb_per_step", ".3f", "not measured"),
    ("final loss", "final_eval", ".4f", "-"),
    ("vs target", "final_vs_target", "+.2%", "-"),
)


def judged_tables(results: dict, quick_h: dict):
    """(title, rows of formatted cells) for every (workload, rate) that has a target."""
    for workload, by_rate in results.items():
        for rate in by_rate:
            rows = judge(results, workload, rate, quick_h)
            if rows:
                title = (f"{workload}, {rate} (target: held-out loss {rows[0]['target']:.4f}, "
                         f"torch DDP's at the end; bound {_fmt(rows[0]['bound_s'], '.1f')} s)")
                yield title, [[_fmt(r[key], spec, none) for _, key, spec, none in COLUMNS]
                              for r in rows]


def table_markdown(results: dict, quick_h: dict) -> str:
    out = []
    for title, rows in judged_tables(results, quick_h):
        out += [f"\n**{title}**\n", "| " + " | ".join(c[0] for c in COLUMNS) + " |",
                "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(out) + "\n"


def print_tables(results: dict, quick_h: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    for title, rows in judged_tables(results, quick_h):
        t = Table(title=title)
        for header, *_ in COLUMNS:
            t.add_column(header, justify="left" if header == "method" else "right")
        for cells in rows:
            t.add_row(*cells)
        console.print(t)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = [(w, r) for w, by in results.items() for r in by]
    if not panels:
        return
    cols = min(2, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.6 * nrows), squeeze=False)
    tab = plt.get_cmap("tab20").colors
    colors = dict(zip(METHODS, tab[::2] + tab[1::2]))  # one colour per method, every panel
    for ax, (workload, rate) in zip(axes.flat, panels):
        runs = results[workload][rate]
        for method, run in runs.items():
            if method == "no-sync" or not run["curve"]:
                continue
            _, ts, losses = zip(*run["curve"])
            style = "--" if method in LOCAL else "-"
            ax.plot(ts, losses, style, marker=".", ms=3, lw=1.2, label=method,
                    color=colors.get(method))
        if "torch-ddp" in runs and runs["torch-ddp"]["final_eval"] is not None:
            ax.axhline(runs["torch-ddp"]["final_eval"], color="k", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{workload}, 2 hosts x 2 ranks, {rate}")
        ax.set_xlabel("training time (s, log)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="dashed: local updates\n(replicas differ between syncs)",
                  title_fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(out: Path, results: dict, quick_h: dict) -> None:
    (out / "table.md").write_text(table_markdown(results, quick_h))
    rows = {w: {r: judge(results, w, r, quick_h) for r in by} for w, by in results.items()}
    (out / "judged.json").write_text(json.dumps(rows, indent=1))
    plot(results, out / "slow_link.png")
    print_tables(results, quick_h)
