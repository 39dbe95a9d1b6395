"""``--collectives auto`` on one host: step time against ``native``, side by side.

Usage: PYTHONPATH=src python benchmarks/collectives_auto.py [--workers 4] [--steps 20]
       [--rounds 3] [--width 1024] [--depth 4]

On one host ``auto`` resolves to ``native`` before any strategy is built
(``SyncOptions.resolved``: no slow link, nothing for a two-level sum to save), so the
claim "never slower than native on one host" holds by construction; this measures it
anyway. ``--workers`` gloo ranks over loopback (one host, as ``gradsync train
--workers N`` runs them) train the same MLP (``depth`` x ``width`` x ``width`` fp32,
GELU) with one exact DataParallel strategy per setting, in alternating blocks of
``--steps`` steps (native then auto, then auto then native, ...) after 3 warm-up
steps each. A step is rank 0's wall time from forward to ``zero_grad``. Printed:
what ``auto`` resolved to, the median step time per setting over every block, each
block's median, and the ratio. The slow-link benchmark (``slow_link.py``) measures
``auto`` on 2 emulated hosts x 2 ranks, where it is hierarchical.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from alternating_blocks import alternate, mlp, mlp_megabytes, summary_lines

import gradsync as gs
from gradsync.engine.strategy.options import SyncOptions
from gradsync.engine.strategy.registry import build_strategy

SETTINGS = ("native", "auto")


def _worker(args) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(gs.rank())
    x = torch.randn(args.batch, args.width, generator=g)
    strategies = {c: build_strategy(mlp(args.width, args.depth), "ddp", "fp32",
                                    torch.optim.SGD, sync=SyncOptions(collectives=c), lr=1e-3)
                  for c in SETTINGS}
    out = alternate(strategies, x, args.rounds, args.steps)
    out["resolved"] = SyncOptions(collectives="auto").resolved().collectives
    for s in strategies.values():
        s.finish()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    res = gs.spawn(_worker, args.workers, args, timeout_s=900)[0]
    mb = mlp_megabytes(args.width, args.depth)
    print(f"MLP {args.depth}x{args.width} ({mb:.1f} MB of gradient), {args.workers} gloo ranks "
          f"on one host, {args.rounds} rounds x {args.steps} steps each, rank 0; auto "
          f"resolved to {res['resolved']}")
    print("\n".join(summary_lines(res, lambda c: f"{c:>6}")))
    med = {c: statistics.median(res["times"][c]) for c in SETTINGS}
    print(f"auto / native: {med['auto'] / med['native']:.3f}")


if __name__ == "__main__":
    main()
