"""`gradsync verify`: K workers against one process (exactness), or `--sampler` (data audit)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def register(sub, help_line: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "verify",
        help=help_line,
        description=(
            "Train a two-layer tanh MLP on a noisy tanh regression on K worker processes and "
            "on one process over "
            "the same global batch (float64), and report drift across replicas, the gap to the "
            "single process and both final losses; exit 1 above --tolerance. Also shows that on "
            "uneven shards the average of per-rank means is off while num_items weighting is "
            "exact. "
            "With --sampler, audit the indices every rank's sampler consumed in one epoch instead."
        ),
    )
    p.add_argument("--workers", type=int, default=8, help="worker processes K (default: 8)")
    p.add_argument(
        "--n", type=int, default=4096, help="samples in the global batch (default: 4096)"
    )
    p.add_argument("--d", type=int, default=16, help="input dimension (default: 16)")
    p.add_argument("--hidden", type=int, default=32, help="hidden units (default: 32)")
    p.add_argument("--steps", type=int, default=200, help="full-batch SGD steps (default: 200)")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate (default: 0.02)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-12,
        help="largest accepted gap to the single process (default: 1e-12)",
    )
    p.add_argument(
        "--sampler",
        action="store_true",
        help="audit DistributedSampler's pad/drop/exact modes over --n indices instead",
    )
    p.set_defaults(run=run)
    return p


def _exactness(args, console: Console) -> int:
    from ..checks.exactness import ExactnessConfig, run_exactness

    cfg = ExactnessConfig(
        n=args.n,
        d=args.d,
        hidden=args.hidden,
        workers=args.workers,
        steps=args.steps,
        lr=args.lr,
        tolerance=args.tolerance,
    )
    with console.status(f"training on {cfg.workers} workers and on one process..."):
        r = run_exactness(cfg)
    t = Table(
        title=f"exactness: {cfg.workers} workers vs one process, N={cfg.n}, "
        f"{cfg.steps} SGD steps, float64"
    )
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("max drift across replicas", f"{r.max_drift:.2e}")
    t.add_row("max gap vs single process", f"{r.max_gap:.2e}")
    t.add_row("final loss, single process", f"{r.single_loss:.6f}")
    t.add_row("final loss, replica 0", f"{r.replica_loss:.6f}")
    sizes = ", ".join(map(str, r.uneven_shard_sizes))
    t.add_row(f"uneven shards ({sizes}): average of means", f"gap {r.uneven_gap_mean_of_means:.2e}")
    t.add_row("uneven shards: num_items weighting", f"gap {r.uneven_gap_num_items:.2e}")
    console.print(t)
    verdict = "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
    console.print(f"{verdict}: drift must be 0 and gaps <= {cfg.tolerance:g}")
    return 0 if r.passed else 1


def _sampler(args, console: Console) -> int:
    from ..checks.sampler_check import run_sampler_check
    from ..errors import UsageError

    if args.workers < 1 or args.n < 1:
        raise UsageError("--workers and --n must be >= 1")
    if args.workers > args.n:
        raise UsageError(f"{args.workers} workers but only {args.n} samples")
    check = run_sampler_check(args.n, args.workers)
    t = Table(title=f"sampler audit: {args.n} indices over {args.workers} ranks, one epoch")
    for col in ("mode", "per-rank counts", "duplicate draws", "missing", "verdict"):
        t.add_column(col)
    for mode, audit in check.audits.items():
        ok, why = check.verdict(mode)
        counts = audit.per_rank_counts
        shown = ", ".join(map(str, counts[:6])) + (" ..." if len(counts) > 6 else "")
        t.add_row(
            mode,
            shown,
            str(audit.n_duplicate_draws),
            str(len(audit.missing)),
            ("[yellow]demo[/] " if mode == "none" else "[green]ok[/] " if ok else "[red]FAIL[/] ")
            + why,
        )
    console.print(t)
    return 0 if check.passed else 1


def run(args) -> int:
    console = Console()
    return _sampler(args, console) if args.sampler else _exactness(args, console)
