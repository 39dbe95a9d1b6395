"""The slow-link benchmark's output: Markdown and terminal tables, the loss-time picture.

Written after every run from ``results.json`` alone (``--render-only`` redraws
them), so this module only reads figures; ``slow_link_judge.py`` computes them.
``results`` is the whole file: ``{"provenance": {...}, "runs": {workload: {rate:
{method: {seed: summary}}}}}``. Every method ran once per seed, so every figure is
shown with its spread, and the provenance (commit, when, how loaded the machine was)
heads the tables: a number without them cannot be checked or reproduced.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from slow_link_judge import ANCHOR, BOUND, judge, mean_curve
from slow_link_methods import LOCAL, METHODS


def _fmt(v, spec, none="-"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _bytes_vs_ddp(r):
    """DDP's link bytes over the method's, in words: a bare ratio reads either way."""
    x = r["bytes_vs_ddp"]
    if x is None:
        return "-"
    if format(x, ".1f") == "1.0":
        return "same"
    return f"{x:.1f}x fewer" if x > 1 else f"{1 / x:.1f}x more"


def _final(r):
    if r["final_eval"] is None:
        return "-"
    return f"{r['final_eval']:.4f} ± {r['final_std']:.4f}"


def _range(pair):
    return "-" if pair is None else f"{pair[0]:.4f}–{pair[1]:.4f}"


def _yes_no(v):
    return "-" if v is None else ("yes" if v else "no")


COLUMNS = (  # header, the cell from a judge row
    ("method", lambda r: r["method"]),
    ("seeds", lambda r: str(len(r["seeds"]))),
    ("time to target (s)", lambda r: _fmt(r["time_to_target_s"], ".1f", "not reached")),
    ("steps", lambda r: _fmt(r["steps_to_target"], "d")),
    ("x torch DDP", lambda r: _fmt(r["speedup_vs_ddp"], ".2f")),
    ("fraction of bound", lambda r: _fmt(r["fraction_of_bound"], ".2f")),
    ("s/step", lambda r: _fmt(r["median_step_s"], ".3f")),
    ("per step vs torch DDP", lambda r: _fmt(r["per_step_vs_ddp"], ".2f")),
    ("MB sent/rank/step (formula)", lambda r: _fmt(r["sent_mb_per_step"], ".3f")),
    ("link MB/step (measured)", lambda r: _fmt(r["link_mb_per_step"], ".3f", "not measured")),
    ("bytes vs DDP", _bytes_vs_ddp),
    ("final loss (mean ± std)", _final),
    ("final range", lambda r: _range(r["final_range"])),
    ("vs target", lambda r: _fmt(r["final_vs_target"], "+.2%")),
    ("within DDP's spread", lambda r: _yes_no(r["within_ddp_spread"])),
)


def _runs(results: dict) -> dict:
    """``results["runs"]``, refusing any run stamped with another commit than the
    file's: a table mixing two versions of the code would credit one with the other's
    numbers, so such runs are rerun (or kept in another ``--out``), never merged. An
    empty ``results`` (nothing run yet) is no runs."""
    if results and "runs" not in results:  # a silent empty table would look like no runs
        raise ValueError("results.json has no \"runs\": it is the single-seed format; "
                         "render it with the commit that wrote it, or rerun into a new --out")
    commit = results.get("provenance", {}).get("commit")
    runs = results.get("runs", {})
    for workload, by_rate in runs.items():
        for rate, by_method in by_rate.items():
            for method, seeds in by_method.items():
                for seed, run in seeds.items():
                    if "commit" in run and run["commit"] != commit:
                        raise ValueError(
                            f"{workload}/{rate}/{method} seed {seed} was run at commit "
                            f"{run['commit']}, results.json is for {commit}: runs of "
                            "different commits are never merged into one table (rerun it, "
                            "or keep it in another --out)")
    return runs


def provenance_line(results: dict) -> str:
    """Which code, when, on what, and how busy the machine was: the load matters
    because step times are the measurement."""
    prov = results.get("provenance", {})
    commit = prov.get("commit") or "unknown"
    short = commit[:12] + (f" +dirty:{commit.split('dirty:')[1]}" if "dirty:" in commit else "")
    summaries = [run for by_rate in _runs(results).values() for by_method in by_rate.values()
                 for seeds in by_method.values() for run in seeds.values()]
    dates = sorted(s["date"] for s in summaries if s.get("date"))
    loads = [x for s in summaries for x in (s.get("load") or []) if x is not None]
    when = f"runs {dates[0]} to {dates[-1]}" if dates else "no dated runs"
    load = f"1-min load {min(loads):.2f}–{max(loads):.2f}" if loads else "load not recorded"
    return (f"commit {short}, {len(summaries)} runs, {when}, {load}, "
            f"machine: {prov.get('machine', 'unknown')}")


def judged_tables(results: dict, quick_h: dict):
    """(title, rows of formatted cells) for every (workload, rate) that has a target."""
    runs = _runs(results)
    for workload, by_rate in runs.items():
        for rate in by_rate:
            rows = judge(runs, workload, rate, quick_h)
            if not rows:
                continue
            ddp = next(r for r in rows if r["method"] == ANCHOR)
            lo, hi = ddp["target_range"]
            title = (f"{workload}, {rate}: target held-out loss {ddp['target']:.4f} ± "
                     f"{ddp['target_std']:.4f} (torch DDP's mean final over "
                     f"{len(ddp['seeds'])} seeds, range {lo:.4f}–{hi:.4f}); "
                     f"bound {_fmt(ddp['bound_s'], '.1f')} s")
            yield title, [[cell(r) for _, cell in COLUMNS] for r in rows]


def table_markdown(results: dict, quick_h: dict) -> str:
    out = [f"_{provenance_line(results)}_\n"]
    for title, rows in judged_tables(results, quick_h):
        out += [f"\n**{title}**\n", "| " + " | ".join(c[0] for c in COLUMNS) + " |",
                "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(out) + "\n"


def print_tables(results: dict, quick_h: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)  # wide tables: lines a terminal wraps beat cells split
    console.print(provenance_line(results))
    for title, rows in judged_tables(results, quick_h):
        t = Table(title=title)
        for header, _ in COLUMNS:
            t.add_column(header, justify="left" if header == "method" else "right",
                         no_wrap=header.startswith("final") or header == "method")
        for cells in rows:
            t.add_row(*cells)
        console.print(t)


def _panel_curves(runs: dict, workload: str, rate: str):
    """(method, label, mean curve) per method and DDP's target (None without DDP): the
    judge's rows where there is a target, else the same mean curves without one."""
    rows = judge(runs, workload, rate, {})  # curves and target do not depend on H
    if rows:  # a label is the method, or the method and " (4x samples)"
        curves = [(r["method"].split(" (")[0], r["method"], r["curve"]) for r in rows]
        return curves, rows[0]["target"]
    return [(m, m, mean_curve(seeds)) for m, seeds in runs[workload][rate].items() if seeds], None


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    runs = _runs(results)
    panels = [(w, r) for w, by in runs.items() for r in by]
    if not panels:
        return
    cols = min(2, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.6 * nrows), squeeze=False)
    tab = plt.get_cmap("tab20").colors
    colors = dict(zip(METHODS, tab[::2] + tab[1::2]))  # one colour per method, every panel
    for ax, (workload, rate) in zip(axes.flat, panels):
        curves, target = _panel_curves(runs, workload, rate)
        for method, label, curve in curves:
            if method == BOUND or not curve:  # the bound is a step time, not a curve
                continue
            _, ts, losses, stds = zip(*curve)
            style = "--" if method in LOCAL else "-"
            ax.plot(ts, losses, style, marker=".", ms=3, lw=1.2, label=label,
                    color=colors.get(method))
            ax.fill_between(ts, [m - s for m, s in zip(losses, stds)],
                            [m + s for m, s in zip(losses, stds)], color=colors.get(method),
                            alpha=0.15, lw=0)
        if target is not None:
            ax.axhline(target, color="k", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{workload}, 2 hosts x 2 ranks, {rate}")
        ax.set_xlabel("training time (s, log; mean over seeds)")
        ax.set_ylabel("held-out loss (mean ± std over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="dashed: local updates\n(replicas differ between syncs)"
                  "\ndotted: target", title_fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(out: Path, results: dict, quick_h: dict) -> None:
    """table.md, judged.json (the judge's rows, with the provenance) and slow_link.png
    into ``out``, and the tables on the terminal."""
    runs = _runs(results)  # refuses mixed commits before anything is written
    (out / "table.md").write_text(table_markdown(results, quick_h))
    rows = {w: {r: judge(runs, w, r, quick_h) for r in by} for w, by in runs.items()}
    judged = {"provenance": results.get("provenance", {}), "judged": rows}
    (out / "judged.json").write_text(json.dumps(judged, indent=1))
    plot(results, out / "slow_link.png")
    print_tables(results, quick_h)
