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

This file plans and launches; ``collectives_netlab_worker.py`` is what runs on
the hosts, ``collectives_netlab_report.py`` renders the tables and the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # its sibling modules, also when loaded by path
    sys.path.append(str(HERE))
WORKER = HERE / "collectives_netlab_worker.py"

from collectives_netlab_report import links_rows, picture, table  # noqa: E402
from collectives_netlab_worker import ALGOS  # noqa: E402


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
            results = lab.torchrun([str(WORKER), out, json.dumps(
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


def main() -> int:
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
    from gradsync.netlab.links import tc_rate
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
