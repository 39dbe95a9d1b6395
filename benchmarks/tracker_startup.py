"""What `--log tensorboard,csv,wandb,mlflow` adds to a run's start-up: the time to its first step.

    python benchmarks/tracker_startup.py [--rounds 3] [--log tensorboard,csv,wandb,mlflow]

Runs the same short `gradsync train` (tiny float64 MLP, 2 workers, 20 steps) with and
without ``--log``, alternating, each a fresh command in a fresh run directory, and
prints the median seconds from the command's start to the first step's line in
metrics.jsonl (what the user waits for) and to the command's end. W&B's and MLflow's
home directories are temporary: nothing reaches the user's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["train", "--workers", "2", "--steps", "20", "--global-batch", "8", "--micro-batch", "2",
        "--eval-every", "10", "--drift-every", "0", "--no-report",
        "--model", "tests.train.factories:tiny64", "--data", "tests.train.factories:regression64"]


def one(log: str, base: str, k: int) -> tuple[float, float]:
    out = os.path.join(base, f"run-{k}")
    metrics = os.path.join(out, "metrics.jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)}
    env.update({v: os.path.join(base, "home") for v in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                                         "WANDB_DATA_DIR")})
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gradsync.cli", *ARGS, "--out", out,
                             *(["--log", log] if log else [])], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None or first is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics):
            first = time.perf_counter() - t0
        if proc.poll() is not None and first is None:
            raise SystemExit(f"the run failed (exit {proc.returncode}): {' '.join(ARGS)}")
        time.sleep(0.02)
    proc.wait()
    return first, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--log", default="tensorboard,csv,wandb,mlflow")
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"": [], args.log: []}
    with tempfile.TemporaryDirectory() as base:
        k = 0
        for r in range(args.rounds):
            for log in ("", args.log) if r % 2 == 0 else (args.log, ""):
                k += 1
                runs[log].append(one(log, base, k))
                print(json.dumps({"log": log or "none", "first_step_s": runs[log][-1][0],
                                  "total_s": runs[log][-1][1]}), flush=True)
    for log, got in runs.items():
        print(f"--log {log or '(none)'}: first step after "
              f"{statistics.median(g[0] for g in got):.2f} s, command "
              f"{statistics.median(g[1] for g in got):.2f} s (median of {len(got)})")


if __name__ == "__main__":
    main()
