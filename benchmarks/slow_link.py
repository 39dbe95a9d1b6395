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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "slow_link_worker.py"

NO_PROBE = ["--probe-every", "0"]
"""Compressed runs skip `gradsync train`'s exact-gradient probe (an exact all-reduce every
25 steps, to record the compressed gradient's distance): a diagnostic, not part of the
method, and over a slow link it costs an exact step each time."""

METHODS: dict[str, list[str]] = {
    "torch-ddp": ["--strategy", "torch-ddp"],
    "exact": [],
    "hierarchical": ["--collectives", "hierarchical"],
    "bf16": ["--compress", "bf16", *NO_PROBE],
    "fp16": ["--compress", "fp16", *NO_PROBE],
    "int8": ["--compress", "int8", *NO_PROBE],
    "powersgd:4": ["--compress", "powersgd:4", *NO_PROBE],
    "diloco-25": ["--sync", "diloco", "--sync-every", "25"],
    "diloco-100": ["--sync", "diloco", "--sync-every", "100"],
    "streaming": ["--sync", "streaming-diloco", "--sync-every", "25", "--fragments", "4",
                  "--sync-delay", "1", "--sync-alpha", "0.5"],
    "diloco-25-hosts": ["--sync", "diloco", "--sync-every", "25", "--collectives",
                        "hierarchical"],
    "streaming-hosts": ["--sync", "streaming-diloco", "--sync-every", "25", "--fragments", "4",
                        "--sync-delay", "1", "--sync-alpha", "0.5", "--collectives",
                        "hierarchical"],
    "no-sync": ["--sync", "diloco", "--sync-every", "1000000000"],
    "diloco-25-4x": ["--sync", "diloco", "--sync-every", "25"],
    "diloco-25-const": ["--sync", "diloco", "--sync-every", "25", "--schedule", "constant"],
    "torch-ddp-const": ["--strategy", "torch-ddp", "--schedule", "constant"],
}
"""method -> its `gradsync train` flags (on top of the workload's)."""

SAMPLES_X = {"diloco-25-4x": 4}
"""Methods given a multiple of the common sample budget (steps; the schedule stretches
with them): outside the equal-budget comparison, shown as such. On a slow link data is
cheap and bandwidth is not, so "how soon does DiLoCo get there if it may read more" is
the practical question when it cannot at equal samples."""

WORKLOADS: dict[str, dict] = {
    # Communication-bound: 8.4 M parameters (32 MiB of float32 gradient) and little compute.
    "mlp": {"steps": 100, "eval_every": 5,
            "flags": ["--model", "slow_link_worker:mlp", "--data", "teacher",
                      "--optimizer", "adamw", "--lr", "1e-3", "--warmup", "10",
                      "--global-batch", "128", "--micro-batch", "32"]},
    # The built-in GPT (0.84 M parameters) on the standard library's sources.
    "gpt": {"steps": 200, "eval_every": 10,
            "flags": ["--model", "gpt", "--data", "pysrc", "--optimizer", "adamw",
                      "--lr", "3e-3", "--warmup", "20", "--global-batch", "16",
                      "--micro-batch", "4", "--seq-len", "128"]},
}

TOLERANCE = 1e-3
LOCAL = {"diloco-25": 25, "diloco-100": 100, "streaming": None, "no-sync": None,
         "diloco-25-4x": 25, "diloco-25-const": 25, "diloco-25-hosts": 25,
         "streaming-hosts": None}
"""Local-update methods -> the interval at which their replicas are identical (None: only
at the end of the run)."""


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


# --------------------------------------------------------------------------- reading runs
def summarise(rows: list[dict]) -> dict:
    """Per-run figures from metrics.jsonl: the curve and the per-step medians."""
    train_t, curve = 0.0, []
    for r in rows:
        train_t += r["step_time_s"]
        if r.get("eval_loss") is not None:
            curve.append((r["step"], train_t, r["eval_loss"]))
    steady = [r["step_time_s"] for r in rows[2:-1]] or [r["step_time_s"] for r in rows]
    sent = [r.get("sent_bytes") or 0 for r in rows]
    return {"curve": curve, "steps": len(rows), "median_step_s": statistics.median(steady),
            "train_s": train_t, "sent_bytes_per_step": sum(sent) / max(1, len(sent)),
            "final_eval": curve[-1][2] if curve else None}


def comparable(method: str, step: int, last: int, quick_h: dict) -> bool:
    """Is the model at ``step`` one model (every replica identical)?"""
    if method not in LOCAL:
        return True
    h = quick_h.get(method, LOCAL[method])
    return step == last or (h is not None and step % h == 0)


def judge(results: dict, workload: str, rate: str, quick_h: dict) -> list[dict]:
    """The table's rows for one (workload, rate): time to target, fraction of bound."""
    runs = results.get(workload, {}).get(rate, {})
    anchor = runs.get("torch-ddp")
    if not anchor or anchor.get("final_eval") is None:
        return []
    target = anchor["final_eval"]
    limit = target * (1 + TOLERANCE)

    def reach(run, method):
        last = run["steps"]
        for step, t, loss in run["curve"]:
            if loss <= limit and comparable(method, step, last, quick_h):
                return step, t
        return None, None

    anchor_step, anchor_t = reach(anchor, "torch-ddp")
    bound_run = runs.get("no-sync")
    bound_t = anchor_step * bound_run["median_step_s"] if bound_run and anchor_step else None
    exact_step = runs.get("exact", {}).get("median_step_s")
    rows = []
    for method, run in runs.items():
        step, t = reach(run, method) if method != "no-sync" else (None, None)
        label = f"{method} ({SAMPLES_X[method]}x samples)" if method in SAMPLES_X else method
        rows.append({
            "method": label, "target": target, "steps_to_target": step, "time_to_target_s": t,
            "speedup_vs_ddp": anchor_t / t if t and anchor_t else None,
            "fraction_of_bound": bound_t / t if t and bound_t else None,
            "bound_s": bound_t, "median_step_s": run["median_step_s"],
            "per_step_vs_exact": exact_step / run["median_step_s"] if exact_step else None,
            "sent_mb_per_step": run["sent_bytes_per_step"] / 1e6,
            "final_eval": run["final_eval"],
            "final_vs_target": (run["final_eval"] / target - 1) if run["final_eval"] else None,
        })
    return rows


# --------------------------------------------------------------------------- output
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


# --------------------------------------------------------------------------- running
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
    results = lab.torchrun(args, procs_per_host=2, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.returncode != 0]
    if failed:
        tail = (failed[0].stderr or failed[0].stdout or "")[-1500:]
        raise RuntimeError(f"{workload}/{method} over {lab.rate}: host {failed[0].host} "
                           f"exited {failed[0].returncode}:\n{tail}")
    from gradsync.rundir import METRICS, read_metrics

    summary = summarise(read_metrics(str(run_dir / METRICS))[0])
    summary["wall_s"] = wall
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
