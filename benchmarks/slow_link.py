"""Time to a target loss over a slow link: every method against torch DDP, over seeds.

    sudo .venv/bin/python benchmarks/slow_link.py                 # everything, 3 seeds
    .venv/bin/python benchmarks/slow_link.py --quick              # a few steps, one seed
    .venv/bin/python benchmarks/slow_link.py --workloads mlp --methods torch-ddp,auto-int8
    .venv/bin/python benchmarks/slow_link.py --render-only        # tables and PNG from results.json

Two emulated hosts x 2 ranks (``gradsync.netlab``: network namespaces, the link
between them rate-limited with tbf both ways, ranks of one host over its
loopback), one torchrun agent per host. Every method runs the same `gradsync
train` loop (``slow_link_worker.py``) with the same model, data, global batch,
learning-rate schedule and number of steps; only how gradients travel differs.
``slow_link_methods.py`` lists the methods and workloads: the anchor ``torch-ddp``
(torch's DistributedDataParallel), gradsync's exact mean flat (``exact``) or as its
default picks on 2 hosts x 2 ranks (``auto``: hierarchical), int8 compression flat or
across hosts only (``auto-int8``, also one step delayed), DiLoCo variants, and
``no-sync`` (no communication at all: the bound).

Every method runs once per seed (``--seeds``, default 0,1,2: the seed sets the
initialisation, the data order and, for the MLP, the teacher); seeds are the outer
loop, so the anchor and the methods of one seed run side by side, alternating, under
the same machine conditions. ``slow_link_judge.py`` says how they are judged: the target is
torch DDP's mean final held-out loss, a method reaches it when its mean curve does,
finals are reported as mean, spread and range beside DDP's.

Every run is stamped with the code's commit, its date and the machine's load, and a
results file holds one commit only (``slow_link_provenance.py``): runs of different
code are never merged. Bytes are measured on the emulated link (host 0's interface
counters after every step, ``slow_link_worker.LinkCounter``) beside the formula.

Results go to ``--out`` (``results.json``, ``table.md``, ``judged.json``,
``slow_link.png``), written after every run, so an interrupted benchmark keeps what it
measured; the same command continues it (completed runs are kept unless ``--force``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # its sibling modules, also when loaded by path (the tests)
    sys.path.append(str(HERE))
WORKER = HERE / "slow_link_worker.py"

import slow_link_provenance as provenance  # noqa: E402
from slow_link_judge import summarise  # noqa: E402
from slow_link_methods import LOCAL, METHODS, SAME_SCHEDULE_ANCHOR, SAMPLES_X, WORKLOADS  # noqa: E402
from slow_link_render import render  # noqa: E402

QUICK_H = 2
"""--quick: every interval (and warm-up) shrinks to this many steps, so an 8-step smoke run
still syncs."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--rates", default="100mbit", help="inter-host link rates (tc)")
    p.add_argument("--methods", default=None,
                   help="comma-separated; default: each workload's own list")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (at least 3 for a "
                   "verdict)")
    p.add_argument("--steps", type=int, default=None, help="override every workload's steps")
    p.add_argument("--quick", action="store_true", help="8 steps, one seed, H = 2: a smoke run")
    p.add_argument("--out", default="runs/slow_link", help="results directory")
    p.add_argument("--force", action="store_true", help="rerun runs already in results.json")
    p.add_argument("--fresh", action="store_true",
                   help="results.json is of other code: start it over (the old file is kept)")
    p.add_argument("--render-only", action="store_true", help="tables and PNG only")
    p.add_argument("--timeout", type=float, default=1500.0, help="per run, seconds")
    return p.parse_args(argv)


def method_flags(method: str, quick: bool) -> list[str]:
    """The method's flags; --quick shrinks every interval and warm-up to QUICK_H."""
    flags = list(METHODS[method])
    for name in ("--sync-every", "--sync-warmup", "--outer-momentum-warmup"):
        if quick and name in flags and int(flags[flags.index(name) + 1]) < 10**6:
            flags[flags.index(name) + 1] = str(QUICK_H)
    return flags


def run_one(lab, workload: str, method: str, seed: int, steps: int, eval_every: int,
            out: Path, timeout: float, quick: bool) -> dict:
    run_dir = out / "runs" / f"{workload}-{lab.rate}-{method.replace(':', '')}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [str(WORKER), *WORKLOADS[workload]["flags"], *method_flags(method, quick),
            "--seed", str(seed), "--steps", str(steps), "--eval-every", str(eval_every),
            "--checkpoint-every", "0", "--no-report", "--resume", "never", "--timeout", "300",
            "--out", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "src")]),
           "OMP_NUM_THREADS": "1"}
    load_before, t0 = provenance.load(), time.perf_counter()
    results = lab.torchrun(args, procs_per_host=2, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.returncode != 0]
    if failed:
        tail = (failed[0].stderr or failed[0].stdout or "")[-1500:]
        raise RuntimeError(f"{workload}/{method} seed {seed} over {lab.rate}: host "
                           f"{failed[0].host} exited {failed[0].returncode}:\n{tail}")
    from gradsync.rundir import METRICS, read_metrics

    link_path = run_dir / "link_bytes.jsonl"
    link_rows = ([json.loads(line) for line in link_path.read_text().splitlines()]
                 if link_path.exists() else None)
    summary = summarise(read_metrics(str(run_dir / METRICS))[0], link_rows)
    summary.update(wall_s=wall, seed=seed, date=provenance.now(),
                   load=[load_before, provenance.load()])
    return summary


def plan(args) -> list[tuple[str, str, list[str]]]:
    """(rate, workload, methods) in running order; a method with its own schedule brings
    the anchor under that schedule."""
    out = []
    for rate in args.rates.split(","):
        for workload in args.workloads.split(","):
            if workload not in WORKLOADS:
                raise SystemExit(f"unknown workload {workload!r}; choose from "
                                 f"{', '.join(WORKLOADS)}")
            methods = (args.methods.split(",") if args.methods
                       else list(WORKLOADS[workload]["methods"]))
            unknown = [m for m in methods if m not in METHODS]
            if unknown:
                raise SystemExit(f"unknown method(s) {unknown}; choose from "
                                 f"{', '.join(METHODS)}")
            methods += [a for m, a in SAME_SCHEDULE_ANCHOR.items()
                        if m in methods and a not in methods]
            if "torch-ddp" not in methods:
                print(f"note: {workload} without torch-ddp has no target; its runs are kept "
                      "for a later render")
            out.append((rate, workload, methods))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    quick_h = {m: QUICK_H for m, h in LOCAL.items() if h} if args.quick else {}
    if args.render_only:
        render(out, results, quick_h)
        return 0
    from gradsync.netlab import Netlab, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"slow_link.py needs emulated hosts: {reason}")
    todo = plan(args)
    results = provenance.start(results, args.fresh, results_path)
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",") if s]
    for rate, workload, methods in todo:
        spec = WORKLOADS[workload]
        base = 8 if args.quick else (args.steps or spec["steps"])
        eval_every = 2 if args.quick else spec["eval_every"]
        with Netlab(hosts=2, rate=rate) as lab:
            for seed in seeds:
                for method in methods:
                    steps = base * SAMPLES_X.get(method, 1)
                    runs = results["runs"].setdefault(workload, {}).setdefault(rate, {})
                    done = runs.get(method, {}).get(str(seed))
                    if done and not args.force and done.get("steps") == steps:
                        continue
                    print(f"[{time.strftime('%H:%M:%S')}] {workload} over {rate}, seed {seed}: "
                          f"{method} ({steps} steps)", flush=True)
                    summary = run_one(lab, workload, method, seed, steps, eval_every, out,
                                      args.timeout, args.quick)
                    summary["commit"] = results["provenance"]["commit"]
                    print(f"    {summary['median_step_s']:.3f} s/step, final held-out loss "
                          f"{summary['final_eval']:.4f}, {summary['train_s']:.1f} s training, "
                          f"{summary['wall_s']:.1f} s wall", flush=True)
                    runs.setdefault(method, {})[str(seed)] = summary
                    results_path.write_text(json.dumps(results, indent=1))
        render(out, results, quick_h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
