"""Step time of compressed DataParallel with and without ``--compress-delay 1``.

Usage: PYTHONPATH=src python benchmarks/compress_delay.py [--steps 30] [--rounds 2]
       [--width 512] [--depth 4] [--method int8]

Two gloo ranks over loopback train the same MLP (``depth`` x ``width`` x ``width``
fp32 layers: 4 x 512 x 512 is 4.2 MB of gradient) with the same compressor, one
strategy with delay 0 and one with delay 1, in alternating blocks of ``--steps``
steps (0 then 1, then 1 then 0, ...), after 3 warm-up steps each. A step is rank
0's wall time from forward to ``zero_grad``, the loop's shape (backward, clip
measurement, optimizer step). Printed: the median step time per delay over every
block, and each block's median, so the spread between blocks shows.
"""

from __future__ import annotations

import argparse

import torch
from alternating_blocks import alternate, mlp, mlp_megabytes, summary_lines

import gradsync as gs
from gradsync.engine.strategy.options import SyncOptions
from gradsync.engine.strategy.registry import build_strategy


def _worker(args) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(gs.rank())
    x = torch.randn(args.batch, args.width, generator=g)
    strategies = {d: build_strategy(mlp(args.width, args.depth), "ddp", "fp32",
                                    torch.optim.SGD, sync=SyncOptions(
                                        compress=args.method, compress_delay=d, probe_every=0),
                                    lr=1e-3)
                  for d in (0, 1)}
    out = alternate(strategies, x, args.rounds, args.steps, clip=True)
    for s in strategies.values():
        s.finish()
        s.reduction.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--method", default="int8")
    args = ap.parse_args()
    res = gs.spawn(_worker, 2, args, timeout_s=600)[0]
    mb = mlp_megabytes(args.width, args.depth)
    print(f"{args.method}, MLP {args.depth}x{args.width} ({mb:.1f} MB of gradient), 2 ranks "
          f"gloo, {args.rounds} rounds x {args.steps} steps per delay, rank 0")
    print("\n".join(summary_lines(res, lambda d: f"delay {d}")))


if __name__ == "__main__":
    main()
