"""Does bucket_cap_mb="auto" land within 5% of the best cap of a measured sweep?

    python benchmarks/autotune.py [--model mlp|gpt] [--rounds 6] [--steps 4]

In each worker: one DataParallel per fixed cap of the sweep, plus one with
``bucket_cap_mb="auto"`` that first tunes itself (its tuning steps are not
timed). Then all of them run alternating timed blocks in one invocation, so the
machine's noise falls on every variant alike. Prints the median step time per
cap, the sweep's best, the cap "auto" chose and the ratio auto / best.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import gradsync as gs
from gradsync.engine.buckets.autotune import candidate_caps_mb

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ddp_vs_torch import _setup  # noqa: E402  (same models and batches as the DDP benchmark)


def _worker(model_name: str, rounds: int, steps: int):
    probe, *_ = _setup(model_name, seed=0)
    total = sum(p.numel() * p.element_size() for p in probe.parameters())
    caps = candidate_caps_mb(total)
    variants = {}
    for cap in [*caps, "auto"]:
        module, loss_fn, items, opt_cls, opt_kw = _setup(model_name, seed=0)
        dp = gs.DataParallel(module, bucket_cap_mb=cap)
        variants[cap] = (dp, opt_cls(dp.parameters(), **opt_kw), loss_fn, items)

    def step(key):
        dp, opt, loss_fn, items = variants[key]
        dp.backward(loss_fn(dp), num_items=items)
        opt.step()
        opt.zero_grad(set_to_none=True)

    tuner_steps = 0
    while not variants["auto"][0].autotune_result.chosen_mb:
        step("auto")
        tuner_steps += 1
    for key in caps:
        for _ in range(2):
            step(key)
    keys = [*caps, "auto"]
    times = {k: [] for k in keys}
    for r in range(rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                step(key)
                times[key].append(time.perf_counter() - t0)
    chosen = variants["auto"][0].autotune_result.chosen_mb
    return ({str(k): statistics.median(v) for k, v in times.items()}, chosen, tuner_steps) \
        if gs.rank() == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", choices=("mlp", "gpt"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    console = Console()
    console.print(f"[bold]python benchmarks/autotune.py {' '.join(sys.argv[1:])}[/]  "
                  f"torch {torch.__version__}, {args.workers} workers on gloo")
    medians, chosen, tuner_steps = gs.spawn(_worker, args.workers, args.model, args.rounds,
                                            args.steps)[0]
    table = Table(title=f"{args.model}: median step time per bucket cap (ms)")
    table.add_column("bucket cap (MiB)", justify="right")
    table.add_column("median step (ms)", justify="right")
    fixed = {k: v for k, v in medians.items() if k != "auto"}
    best = min(fixed, key=fixed.get)
    for k, v in medians.items():
        label = f"auto -> {chosen:.2f}" if k == "auto" else f"{float(k):.2f}"
        mark = " (best of sweep)" if k == best else ""
        table.add_row(label, f"{v * 1e3:.1f}{mark}")
    console.print(table)
    ratio = medians["auto"] / fixed[best]
    console.print(f"auto chose {chosen:.2f} MiB after {tuner_steps} tuning steps; "
                  f"auto / best = {ratio:.3f} (target <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
