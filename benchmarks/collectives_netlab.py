"""Reference all-reduce algorithms on emulated hosts, measured against the alpha-beta model.

Usage (root; builds network namespaces, see docs/netlab.md):

    python benchmarks/collectives_netlab.py --quick          # 4 configurations, 3 sizes
    python benchmarks/collectives_netlab.py --rate 100mbit --hosts 2,3,4 --procs-per-host 1,2 \
        --png netlab.png --json netlab.json

For each configuration (H emulated hosts x g ranks per host, links at ``--rate``
each way) one torchrun agent per host starts g workers, which first time the
intra- and inter-host links (``gradsync.calibrate.links``: an exchange between
two ranks, fitted to alpha + bytes x beta), then time every algorithm of
``gradsync.engine.transport.algorithms`` (ring, binomial tree, parameter server,
hierarchical) per message size: a barrier, one all-reduce (messages under 1 MB
repeated up to 8 times and averaged), the slowest rank's time, median of
``--reps``. The prediction next to each measurement is ``plan.two_level`` with
the links measured in the same run, so the table reads "does the round model
explain what ran". A point whose prediction at the nominal rate exceeds
``--max-op-s`` is skipped (the parameter server at 64 MB on 4 hosts takes a
minute at 100 Mbit/s) and listed as skipped.

The parameter server's saturation is shown in measurement: with one rank per
host, its time at the largest size measured on every host count grows with the
workers (its root's link carries (N-1) S each way), while the ring's stays
about 2 S / rate. The PNG's last panel plots exactly that.

Figures depend on this machine's load (all ranks of all hosts share its cores):
re-measure on a quiet machine before quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ALGOS = ("ring", "tree", "server", "hierarchical")


# -- worker (runs under torchrun inside an emulated host) ---------------------------------

def worker(points: list[tuple[str, int]], link_sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import gradsync as gs
    from gradsync.calibrate.links import measure_worker
    from gradsync.engine.transport import comm
    from gradsync.engine.transport.algorithms import ALGORITHMS, HostTopology, hierarchical

    torch.set_num_threads(1)
    gs.init()
    links = measure_worker(link_sizes, reps)
    top = HostTopology.from_env()
    world = top.world_size
    run = dict(ALGORITHMS, hierarchical=lambda t: hierarchical.all_reduce_(t, top))
    mine = []
    for algo, nbytes in points:
        t = torch.ones(nbytes // 4)
        run[algo](t)  # the check: a sum of ones is exact in float32
        if not (t.min().item() == t.max().item() == world):
            raise AssertionError(f"{algo} at {nbytes} B: wrong sum")
        inner = max(1, min(8, (1 << 20) // nbytes))
        for _ in range(inner):  # warm-up: fresh connections start slow (TCP slow start)
            t.fill_(1.0)
            run[algo](t)
        for _ in range(reps):
            t.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                run[algo](t)
            mine.append((time.perf_counter() - t0) / inner)
    flat = torch.tensor(mine, dtype=torch.float64)
    table = torch.empty(world * flat.numel(), dtype=torch.float64)
    comm.all_gather_single(table, flat, tag="bench")
    if dist.get_rank() == 0:
        slowest = table.view(world, -1).max(dim=0).values.view(len(points), reps)
        medians = [statistics.median(row) for row in slowest.tolist()]
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"links": links, "points": [[a, n, m] for (a, n), m in
                                                   zip(points, medians)]}, f)
    top.close()
    gs.shutdown()


# -- parent: plan, launch under netlab, compare, render ------------------------------------

def nominal_topology(hosts, g, rate_bytes):
    from gradsync.plan.two_level import Link, TwoLevelTopology

    return TwoLevelTopology(hosts, g, Link(1e-4, 1 / 1e9), Link(5e-4, 1 / rate_bytes))


def measure(config, args, sizes, link_sizes, rate_bytes):
    from gradsync.calibrate.links import summarise
    from gradsync.netlab import Netlab
    from gradsync.plan.two_level import predict

    hosts, g = config
    nominal = nominal_topology(hosts, g, rate_bytes)
    points, skipped = [], []
    for algo in ALGOS:
        for n in sizes:
            est = predict(algo, n, nominal).seconds
            (skipped if est > args.max_op_s else points).append((algo, n))
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as tmp:
        out = os.path.join(tmp, "out.json")
        with Netlab(hosts, args.rate) as lab:
            results = lab.torchrun([os.path.abspath(__file__), "--worker", out, json.dumps(
                [points, link_sizes, args.reps])], procs_per_host=g, timeout=args.timeout)
        if any(r.returncode != 0 for r in results) or not os.path.exists(out):
            bad = next(r for r in results if r.returncode != 0)
            raise SystemExit(f"{hosts} hosts x {g}: host {bad.host} failed "
                             f"({bad.returncode}):\n{bad.stderr[-3000:]}")
        with open(out, encoding="utf-8") as f:
            data = json.load(f)
    cal = summarise(data["links"], rate=args.rate)
    topo = cal.topology()
    rows = [{"hosts": hosts, "ranks_per_host": g, "algorithm": a, "nbytes": n,
             "measured_s": m, "predicted_s": predict(a, n, topo).seconds}
            for a, n, m in data["points"]]
    return cal, rows, skipped


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


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        points, link_sizes, reps = json.loads(sys.argv[3])
        worker([tuple(p) for p in points], link_sizes, reps, sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="hosts 2,3,4 x 1 rank and 2 x 2; sizes 16 KB, 256 KB, 4 MB; 3 reps")
    p.add_argument("--rate", default="100mbit", help="each host link, each way (tc units)")
    p.add_argument("--hosts", default="2,3,4")
    p.add_argument("--procs-per-host", default="1,2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-op-s", type=float, default=4.0,
                   help="skip a point predicted (at the nominal rate) to take longer")
    p.add_argument("--timeout", type=float, default=1800.0, help="per configuration, seconds")
    p.add_argument("--png", default="collectives_netlab.png")
    p.add_argument("--json", default="collectives_netlab.json")
    args = p.parse_args()

    from rich.console import Console
    from rich.progress import Progress

    from gradsync.calibrate.collectives import log_sizes
    from gradsync.netlab import unavailable_reason
    from gradsync.netlab.lab import tc_rate
    from gradsync.plan.units import parse_int_list

    reason = unavailable_reason()
    if reason:
        print(f"collectives_netlab: {reason}", file=sys.stderr)
        return 2
    rate_bytes, _ = tc_rate(args.rate)
    if args.quick:
        configs = [(2, 1), (3, 1), (4, 1), (2, 2)]
        # links up to 16 MB even so: with sizes only up to 4 MB the fitted rate of one run
        # came out at 115 Mbit/s on a 100 Mbit/s link (small, noisy sizes pulled the slope)
        sizes, link_sizes, args.reps = [16 << 10, 256 << 10, 4 << 20], log_sizes(
            4096, 16 << 20, 5), 3
    else:
        configs = [(h, g) for g in parse_int_list(args.procs_per_host, "--procs-per-host")
                   for h in parse_int_list(args.hosts, "--hosts")]
        sizes, link_sizes = log_sizes(4096, 64 << 20, 8), log_sizes(4096, 16 << 20, 7)
    rows, skipped, cals = [], [], {}
    console = Console(width=max(130, Console().width))
    with Progress(console=console) as bar:
        task = bar.add_task("configurations", total=len(configs))
        for h, g in configs:
            bar.update(task, description=f"{h} hosts x {g} ranks at {args.rate}")
            cal, got, skip = measure((h, g), args, sizes, link_sizes, rate_bytes)
            cals[(h, g)] = cal
            rows += got
            skipped += [(h, g, a, n) for a, n in skip]
            bar.advance(task)
    console.print(links_rows(cals))
    console.print(table(rows, skipped, args.rate))
    import dataclasses

    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"rate": args.rate, "rows": rows, "skipped": skipped,
                   "links": {f"{h}x{g}": dataclasses.asdict(c) for (h, g), c in cals.items()}},
                  f, indent=1)
    picture(rows, args.rate, args.png)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
