"""`gradsync verify`: K workers against one process (exactness), or `--sampler` (data audit).

Without ``--model`` it runs the worked example (a two-layer tanh regressor, K = 8,
4096 samples, 200 steps); with ``--model``/``--data`` (the factories ``gradsync
train`` takes) it runs the same comparison on the user's own model and data
(``checks/exactness.py``, the one check, on a second workload), with defaults sized
for a real model: 2 workers, 16 samples, 3 steps. Flags of the worked example alone
(``--d``, ``--hidden``) are refused with ``--model``, as ``--sampler`` is.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ..errors import UsageError

BUILTIN = {"workers": 8, "n": 4096, "d": 16, "hidden": 32, "steps": 200}
FACTORIES = {"workers": 2, "n": 16, "steps": 3}


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
            "exact. With --model/--data, the same comparison on your own model and data (as "
            "gradsync train reads them). "
            "With --sampler, audit the indices every rank's sampler consumed in one epoch instead."
        ),
    )
    p.add_argument("--model", help="your model, pkg.module:factory or path/to/file.py:factory "
                   "(as gradsync train --model; built-in gpt and mlp too)")
    p.add_argument("--data", default="", help="its data, as gradsync train --data (default: "
                   "the built-in model's)")
    p.add_argument("--workers", type=int, help="worker processes K (default: 8; with --model 2)")
    p.add_argument("--n", type=int, help="samples in the global batch (default: 4096; with "
                   "--model 16, the first ones of the dataset)")
    p.add_argument("--d", type=int, help="input dimension (default: 16; not with --model)")
    p.add_argument("--hidden", type=int, help="hidden units (default: 32; not with --model)")
    p.add_argument("--steps", type=int, help="full-batch SGD steps (default: 200; with --model 3)")
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


def _fill(args, defaults: dict) -> None:
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _exactness(args, console: Console) -> int:
    """The one exactness check (``checks/exactness.py``) on the worked example or, with
    ``--model``, on the user's own model and data; the same table either way."""
    from ..checks.exactness import Check, Factories, Regression, run_exactness

    own = args.model is not None
    workload = (Factories(model=args.model, data=args.data, samples=args.n) if own
                else Regression(n=args.n, d=args.d, hidden=args.hidden))
    check = Check(workload, workers=args.workers, steps=args.steps, lr=args.lr,
                  tolerance=args.tolerance)
    what = f"{args.model} " if own else ""
    with console.status(f"training {what}on {_plural(check.workers, 'worker')} and on "
                        f"one process..."):
        r = run_exactness(check)
    if own:
        title = (f"exactness of {workload.model} on {workload.data or 'its data'}: "
                 f"{_plural(check.workers, 'worker')} vs one process, the first "
                 f"{_plural(workload.samples, 'sample')}, {_plural(check.steps, 'SGD step')}, "
                 "float64, eval mode")
    else:
        title = (f"exactness: {_plural(check.workers, 'worker')} vs one process, "
                 f"N={workload.n}, {_plural(check.steps, 'SGD step')}, float64")
    t = Table(title=title)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("max drift across replicas", f"{r.max_drift:.2e}")
    t.add_row("max gap vs single process", f"{r.max_gap:.2e}")
    if not own:
        t.add_row("final loss, single process", f"{r.single_loss:.6f}")
        t.add_row("final loss, replica 0", f"{r.replica_loss:.6f}")
    sizes = ", ".join(map(str, r.uneven_shard_sizes))
    t.add_row(f"uneven shards ({sizes}{' samples' if own else ''}): average of means",
              f"gap {r.uneven_gap_mean_of_means:.2e}")
    t.add_row("uneven shards: num_items weighting" + (f" ({r.item_name})" if own else ""),
              f"gap {r.uneven_gap_num_items:.2e}")
    console.print(t)
    verdict = "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
    console.print(f"{verdict}: drift must be 0 and gaps <= {check.tolerance:g}")
    return 0 if r.passed else 1


def _sampler(args, console: Console) -> int:
    from ..checks.sampler_check import run_sampler_check

    if args.workers < 1 or args.n < 1:
        raise UsageError("--workers and --n must be >= 1")
    if args.workers > args.n:
        raise UsageError(f"{args.workers} workers but only {args.n} samples")
    check = run_sampler_check(args.n, args.workers)
    t = Table(title=f"sampler audit: {args.n} indices over {_plural(args.workers, 'rank')}, "
              "one epoch")
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
    if args.model is None:
        if args.data:
            raise UsageError("--data needs --model: the worked example brings its own data")
        _fill(args, BUILTIN)
        return _sampler(args, console) if args.sampler else _exactness(args, console)
    builtin_only = [f for f, v in (("--d", args.d), ("--hidden", args.hidden),
                                   ("--sampler", args.sampler or None)) if v is not None]
    if builtin_only:
        raise UsageError(f"{builtin_only[0]} belongs to the worked example and has no effect "
                         "with --model; drop one of them")
    _fill(args, FACTORIES)
    return _exactness(args, console)
