"""Time to a target loss over a slow link: every method against torch DDP and the bound.

    sudo .venv/bin/python benchmarks/slow_link.py                 # everything (~65 min here)
    .venv/bin/python benchmarks/slow_link.py --quick              # a few steps, to see it work
    .venv/bin/python benchmarks/slow_link.py --workloads mlp --rates 100mbit --methods exact,int8
    .venv/bin/python benchmarks/slow_link.py --render-only        # tables and PNG from results.json

Two emulated hosts x 2 ranks (``gradsync.netlab``: network namespaces, the link
between them rate-limited with tbf both ways, ranks of one host over its
loopback), one torchrun agent per host. Every method runs the same `gradsync
train` loop (``slow_link_worker.py``) with the same model, data, seed, global batch,
learning-rate schedule and number of steps; only how gradients travel differs:

* ``torch-ddp``: torch's DistributedDataParallel, the anchor;
* ``exact``, ``hierarchical``: gradsync's exact mean, flat (gloo's all-reduce over
  all 4 ranks) or inside each host first, then across hosts;
* ``bf16``, ``fp16``, ``int8``, ``powersgd:4``: compressed gradients (int8 and
  PowerSGD with error feedback);
* ``diloco-25``, ``diloco-100``: DiLoCo, H local steps between syncs, every rank a worker;
* ``diloco-25-hosts``, ``streaming-hosts``: the same with a worker per host (exact data
  parallelism over the host's loopback, local updates across the slow link, as the
  DiLoCo paper's workers are islands of accelerators; ``--collectives hierarchical``);
* ``streaming``: streaming DiLoCo, H = 25 in 4 fragments, each overlapped with the
  next step (tau = 1), merged with alpha 0.5;
* ``diloco-25-4x``: DiLoCo H = 25 allowed 4x the samples (4x the steps), outside the
  equal-budget comparison and labelled so: when DiLoCo cannot reach the target on
  the common budget, how soon does it if it may read more?
* ``diloco-25-const``, ``torch-ddp-const``: DiLoCo H = 25 and torch DDP with a
  constant learning rate after warm-up instead of the cosine decay (same samples):
  a schedule that suits local updates, and the anchor under the same schedule, so a
  speed-up bought by the schedule is not credited to the method. The target stays
  the cosine-scheduled DDP's final loss;
* ``no-sync``: the bound -- the same run with no communication at all (DiLoCo
  whose interval is longer than the run). Its step time is compute alone.

What is measured, per workload and link rate:

* **target**: the held-out loss torch DDP has at the end of its budget;
* **time to target**: training time (the sum of step times; held-out evaluations
  are not counted, for any method) until the first evaluation at or below the
  target (within 0.1%, so an exact method whose float32 sums differ from DDP's in
  the last bits still counts). Local-update methods count only evaluations where
  every replica is the same model: DiLoCo's sync steps and the end of the run
  (between syncs, replicas differ, and a held-out loss of "the model" does not
  exist). Streaming DiLoCo's replicas are identical only at the end;
* **bound**: what a method without any communication would need for the target,
  DDP's number of steps to the target x the no-sync run's median step time;
  a method's **fraction of bound** is bound / its time to target (1.0: all the
  communication's cost removed);
* bytes each rank sends per step (the mean over the run), the median step time,
  and the final held-out loss relative to the target.

Results go to ``--out`` (``results.json``, ``table.md``, ``slow_link.png``: held-out
loss against training time for every method), written after every run, so an
interrupted benchmark keeps what it measured (rerun with the same ``--out`` to
finish: completed runs are kept unless ``--force``).

This file runs the methods; ``slow_link_methods.py`` lists them and the workloads,
``slow_link_judge.py`` computes the figures above, ``slow_link_render.py`` draws them.
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

from slow_link_judge import summarise  # noqa: E402
from slow_link_methods import METHODS, SAMPLES_X, WORKLOADS  # noqa: E402
from slow_link_render import render  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp,gpt", help="comma-separated: mlp, gpt")
    p.add_argument("--rates", default="100mbit,400mbit", help="inter-host link rates (tc)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument("--steps", type=int, default=None, help="override every workload's steps")
    p.add_argument("--quick", action="store_true", help="8 steps, H scaled down: a smoke run")
    p.add_argument("--out", default="runs/slow_link", help="results directory")
    p.add_argument("--force", action="store_true", help="rerun runs already in results.json")
    p.add_argument("--render-only", action="store_true", help="tables and PNG only")
    p.add_argument("--timeout", type=float, default=1500.0, help="per run, seconds")
    return p.parse_args(argv)


def run_one(lab, workload: str, method: str, steps: int, eval_every: int, out: Path,
            timeout: float, quick_h: dict) -> dict:
    run_dir = out / "runs" / f"{workload}-{lab.rate}-{method.replace(':', '')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    flags = list(METHODS[method])
    if method in quick_h and quick_h[method]:
        flags[flags.index("--sync-every") + 1] = str(quick_h[method])
    args = [str(WORKER), *WORKLOADS[workload]["flags"], *flags, "--steps", str(steps),
            "--eval-every", str(eval_every), "--checkpoint-every", "0", "--no-report",
            "--resume", "never", "--timeout", "300", "--out", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "src")]),
           "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    links_before = lab.link_bytes()
    results = lab.torchrun(args, procs_per_host=2, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    link_sent = sum(a[0] - b[0] for a, b in zip(lab.link_bytes(), links_before))
    failed = [r for r in results if r.returncode != 0]
    if failed:
        tail = (failed[0].stderr or failed[0].stdout or "")[-1500:]
        raise RuntimeError(f"{workload}/{method} over {lab.rate}: host {failed[0].host} "
                           f"exited {failed[0].returncode}:\n{tail}")
    from gradsync.rundir import METRICS, read_metrics

    summary = summarise(read_metrics(str(run_dir / METRICS))[0])
    summary["wall_s"] = wall
    # measured on the emulated links (every host's interface counter, headers included,
    # start-up and evaluations too): the bytes that crossed between hosts, per step
    summary["link_bytes_per_step"] = link_sent / max(1, steps)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    quick_h = ({"diloco-25": 2, "diloco-100": 4, "streaming": 4, "diloco-25-4x": 2,
                "diloco-25-const": 2, "diloco-25-hosts": 2, "streaming-hosts": 4}
               if args.quick else {})
    if args.render_only:
        render(out, results, quick_h)
        return 0
    from gradsync.netlab import Netlab, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"slow_link.py needs emulated hosts: {reason}")
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if "torch-ddp" not in methods:
        print("note: without torch-ddp there is no target; runs are kept for a later render")
    for rate in args.rates.split(","):
        for workload in args.workloads.split(","):
            spec = WORKLOADS[workload]
            base = 8 if args.quick else (args.steps or spec["steps"])
            eval_every = 2 if args.quick else spec["eval_every"]
            with Netlab(hosts=2, rate=rate) as lab:
                for method in methods:
                    steps = base * SAMPLES_X.get(method, 1)
                    done = results.get(workload, {}).get(rate, {}).get(method)
                    if done and not args.force and done.get("steps") == steps:
                        continue
                    print(f"[{time.strftime('%H:%M:%S')}] {workload} over {rate}: {method} "
                          f"({steps} steps)", flush=True)
                    summary = run_one(lab, workload, method, steps, eval_every, out,
                                      args.timeout, quick_h)
                    print(f"    {summary['median_step_s']:.3f} s/step, final held-out loss "
                          f"{summary['final_eval']:.4f}, {summary['train_s']:.1f} s training, "
                          f"{summary['wall_s']:.1f} s wall", flush=True)
                    results.setdefault(workload, {}).setdefault(rate, {})[method] = summary
                    results_path.write_text(json.dumps(results, indent=1))
            render(out, results, quick_h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
