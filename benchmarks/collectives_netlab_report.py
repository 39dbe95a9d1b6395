"""Tables and the picture of benchmarks/collectives_netlab.py, from its measured rows.

Each row is one (hosts, ranks per host, algorithm, size) point with its measured
and predicted time; the picture's last panel is the parameter server against the
ring at one rank per host, where the server's root link saturates.
"""

from __future__ import annotations

from collectives_netlab_worker import ALGOS


def table(rows, skipped, rate):
    from rich.table import Table

    from gradsync.plan.units import fmt_bytes, fmt_time

    t = Table(title=f"All-reduce on emulated hosts, links {rate} each way: measured (median, "
                    "slowest rank) and measured / predicted by plan.two_level with the links "
                    "measured in the same run")
    for col in ("hosts x ranks", "size", *ALGOS):
        t.add_column(col, justify="right")
    by = {}
    for r in rows:
        by[(r["hosts"], r["ranks_per_host"], r["nbytes"], r["algorithm"])] = r
    keys = sorted({(r["hosts"], r["ranks_per_host"], r["nbytes"]) for r in rows}
                  | {(h, g, n) for h, g, _, n in skipped})
    for h, g, n in keys:
        cells = []
        for a in ALGOS:
            r = by.get((h, g, n, a))
            if r is None:
                cells.append("skipped")
                continue
            ratio = r["measured_s"] / r["predicted_s"]
            cells.append(f"{fmt_time(r['measured_s'])} ({ratio:.2f})")
        t.add_row(f"{h} x {g}", fmt_bytes(n), *cells)
    t.caption = ("cell: measured time (measured / predicted); 'skipped': predicted at the "
                 "nominal rate above --max-op-s")
    return t


def links_rows(cals):
    from rich.table import Table

    from gradsync.plan.units import fmt_time

    t = Table(title="Links measured per configuration (exchange of B bytes both ways)")
    for col in ("hosts x ranks", "intra alpha", "intra bandwidth", "inter alpha",
                "inter bandwidth", "inter R²"):
        t.add_column(col, justify="right")
    for (h, g), cal in cals.items():
        intra = cal.intra.fit if cal.intra else None
        t.add_row(f"{h} x {g}", fmt_time(intra.alpha_s) if intra else "-",
                  f"{intra.bandwidth * 8 / 1e6:,.0f} Mbit/s" if intra else "-",
                  fmt_time(cal.inter.fit.alpha_s),
                  f"{cal.inter.fit.bandwidth * 8 / 1e6:,.0f} Mbit/s", f"{cal.inter.fit.r2:.3f}")
    return t


def picture(rows, rate, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["hosts"], r["ranks_per_host"]) for r in rows})
    ncol = 3
    nrow = (len(configs) + 1 + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 4 * nrow), squeeze=False)
    colors = dict(zip(ALGOS, ("tab:blue", "tab:orange", "tab:red", "tab:green")))
    marks = dict(zip(ALGOS, ("o", "s", "^", "x")))
    for ax, (h, g) in zip(axes.flat, configs):
        for a in ALGOS:
            pts = sorted((r["nbytes"], r["measured_s"], r["predicted_s"]) for r in rows
                         if (r["hosts"], r["ranks_per_host"], r["algorithm"]) == (h, g, a))
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [1e3 * p[1] for p in pts], marks[a], color=colors[a],
                    label=f"{a} measured")
            ax.plot(xs, [1e3 * p[2] for p in pts], "--", color=colors[a], label=f"{a} model")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{h} hosts x {g} rank{'s' if g > 1 else ''}, {rate}")
        ax.set_xlabel("message, bytes")
        ax.set_ylabel("all-reduce time, ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax = axes.flat[len(configs)]
    ones = [(h, g) for h, g in configs if g == 1]
    common = None
    for h, _ in ones:
        sizes = {r["nbytes"] for r in rows if (r["hosts"], r["ranks_per_host"]) == (h, 1)
                 and r["algorithm"] == "server"}
        common = sizes if common is None else common & sizes
    if ones and common:
        n = max(common)
        for a in ("server", "ring"):
            pts = sorted((r["hosts"], r["measured_s"], r["predicted_s"]) for r in rows
                         if r["ranks_per_host"] == 1 and r["algorithm"] == a
                         and r["nbytes"] == n)
            ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "o-", color=colors[a],
                    label=f"{a} measured")
            ax.plot([p[0] for p in pts], [1e3 * p[2] for p in pts], "--", color=colors[a],
                    label=f"{a} model")
        ax.set_title(f"parameter server saturates: {n / 1e6:.1f} MB, 1 rank per host")
        ax.set_xlabel("workers (= hosts)")
        ax.set_ylabel("all-reduce time, ms")
        ax.set_xticks([h for h, _ in ones])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for extra in list(axes.flat)[len(configs) + 1:]:
        extra.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
