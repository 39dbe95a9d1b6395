"""One slow worker: torch DDP (even split), gradsync even split, gradsync balanced, side by side.

    python benchmarks/stragglers.py [--models mlp gpt] [--workers 2 4] [--speeds 1 0.5 0.25]
                                    [--rounds 3] [--steps 8]

For each model, number of workers and speed of the last rank (1: nobody slow),
one spawn runs the three modes in alternating timed blocks (see
stragglers_worker.py; the slowness is emulated identically in every mode).
Prints each mode's median step time, its ratio to the ideal and to torch DDP.

The ideal is the global batch over the sum of the ranks' compute throughputs,
plus what the step spends outside compute: the emulation slows a rank's
forward and backward (``C`` seconds on the even share, calibrated), not its
optimizer step or the wire, so the ideal step is ``T1 + C * (K / sum(speeds) -
1)`` with ``T1`` the gradsync even split's step with nobody slow (measured in
the same table). With 2 ranks, one at half speed and a step that is all
compute, that is 2/1.5 of ``T1``, where an even split, waiting for the slow
half, takes 2x.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

import gradsync as gs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from stragglers_worker import MODES, PER_RANK, worker  # noqa: E402


def run(models, workers, speeds, rounds, steps) -> list[dict]:
    rows = []
    for name in models:
        for k in workers:
            base = None
            for speed in sorted(speeds, reverse=True):  # speed 1 first: the ideal needs it
                per_rank = [1.0] * (k - 1) + [speed]
                res = gs.spawn(worker, k, name, per_rank, rounds, steps, timeout_s=1800)[0]
                med = res["median_s"]
                if speed == 1.0:
                    base = med["gradsync even"]
                a, b = res["calibration"]
                compute = a + b * PER_RANK[name]
                ideal = base + compute * (k / sum(per_rank) - 1) if base else None
                for mode in MODES:
                    rows.append({"model": name, "workers": k, "slow_speed": speed, "mode": mode,
                                 "median_ms": med[mode] * 1e3,
                                 "x_ideal": med[mode] / ideal if ideal else None,
                                 "vs_torch": med["torch DDP"] / med[mode],
                                 "compute_ms": compute * 1e3,
                                 "final_split": res["final_split"]
                                 if mode == "gradsync balanced" else None})
                print(json.dumps(rows[-3:]), flush=True)
    return rows


def table(rows: list[dict]) -> Table:
    t = Table(title="One slow worker: median step time (lower is better)")
    for col in ("model", "workers", "slow rank speed", "mode", "median step", "x ideal",
                "speed-up vs torch DDP", "final split"):
        t.add_column(col, justify="right" if col not in ("model", "mode") else "left")
    for r in rows:
        t.add_row(r["model"], str(r["workers"]), f"{r['slow_speed']:g}", r["mode"],
                  f"{r['median_ms']:.1f} ms",
                  "-" if r["x_ideal"] is None else f"{r['x_ideal']:.2f}",
                  f"{r['vs_torch']:.2f}x", "" if not r["final_split"] else
                  "/".join(map(str, r["final_split"])))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    p.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    p.add_argument("--speeds", nargs="+", type=float, default=[1.0, 0.5, 0.25])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    if 1.0 not in a.speeds:
        a.speeds.append(1.0)  # the ideal is measured against nobody slow
    rows = run(a.models, a.workers, a.speeds, a.rounds, a.steps)
    Console().print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
