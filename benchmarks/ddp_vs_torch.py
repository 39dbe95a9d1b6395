"""gradsync.DataParallel against torch.nn.parallel.DistributedDataParallel, side by side.

    python benchmarks/ddp_vs_torch.py [--workers 2] [--rounds 8] [--steps 5]

Same models, same data, same process count, in one invocation. Inside each worker
both wrappers hold identical copies of the model and run alternating timed
blocks (torch, gradsync plain, gradsync exact, torch, ...), so machine noise hits
all of them alike. Prints the median step time of each and the ratio
gradsync/torch. Models: the 8-layer 1024-wide GELU MLP with SGD (batch 64 per
rank) and the built-in GPT with AdamW (micro-batch 8 x 128 tokens per rank).
"gradsync plain" uses loss.backward() (DDP's convention, like torch);
"gradsync exact" uses model.backward(loss, num_items=n), the path `gradsync train` runs.
Both wrappers use their defaults (25 MiB buckets, 1 MiB first bucket) unless
--bucket-mb is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync as gs
from gradsync.models import build_model

VARIANTS = ("torch DDP", "gradsync plain", "gradsync exact")


def _setup(name: str, seed: int):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(100 + gs.rank())
    if name == "mlp":
        model = build_model("mlp")
        x = torch.randn(64, 1024, generator=g)
        y = torch.randn(64, 1024, generator=g)
        sgd = {"lr": 1e-3, "momentum": 0.9}
        return model, (lambda m: F.mse_loss(m(x), y)), 64, torch.optim.SGD, sgd
    model = build_model("gpt")
    x = torch.randint(0, 256, (8, 128), generator=g)
    y = torch.randint(0, 256, (8, 128), generator=g)

    def loss(m):
        logits = m(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, loss, 8 * 128, torch.optim.AdamW, {"lr": 1e-4}


def _worker(models: list[str], rounds: int, steps: int, bucket_mb: float):
    results = {}
    for name in models:
        wrapped = {}
        for variant in VARIANTS:
            module, loss_fn, items, opt_cls, opt_kw = _setup(name, seed=0)
            if bucket_mb is None:  # both libraries' defaults: 25 MiB cap, 1 MiB first bucket
                m = DDP(module) if variant == "torch DDP" else gs.DataParallel(module)
            elif variant == "torch DDP":  # an explicit cap makes DDP drop its small first bucket
                m = DDP(module, bucket_cap_mb=bucket_mb)
            else:
                m = gs.DataParallel(module, bucket_cap_mb=bucket_mb, first_bucket_mb=bucket_mb)
            wrapped[variant] = (m, opt_cls(m.parameters(), **opt_kw), loss_fn, items)

        def step(variant, wrapped=wrapped):
            m, opt, loss_fn, items = wrapped[variant]
            loss = loss_fn(m)
            if variant == "gradsync exact":
                m.backward(loss, num_items=items)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for variant in VARIANTS:  # warm-up, and gradsync's one-off bucket rebuild
            for _ in range(3):
                step(variant)
        times = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                dist.barrier()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step(variant)
                    times[variant].append(time.perf_counter() - t0)
        results[name] = times
    return results if gs.rank() == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per block (default 5)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket cap for both (default: each library's defaults, 25 MiB with a "
                        "1 MiB first bucket; with a cap given, torch DDP drops its small first "
                        "bucket and so does gradsync here)")
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--json", help="also write the raw step times here")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    console = Console()
    console.print(f"[bold]{' '.join(['python', 'benchmarks/ddp_vs_torch.py', *sys.argv[1:]])}[/]  "
                  f"torch {torch.__version__}, {args.workers} workers on gloo, 1 thread each")
    results = gs.spawn(_worker, args.workers, models, args.rounds, args.steps, args.bucket_mb)[0]
    table = Table(title="median step time (ms), alternating blocks")
    for col in ("model", *VARIANTS, "plain / torch", "exact / torch"):
        table.add_column(col, justify="right")
    summary = {}
    for name, times in results.items():
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        summary[name] = med
        table.add_row(name, *(f"{med[v]:.1f}" for v in VARIANTS),
                      f"{med['gradsync plain'] / med['torch DDP']:.3f}",
                      f"{med['gradsync exact'] / med['torch DDP']:.3f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"medians_ms": summary, "step_times_s": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
