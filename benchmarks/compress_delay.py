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
import statistics
import time

import torch
from torch import nn

import gradsync as gs
from gradsync.engine.strategy.options import SyncOptions
from gradsync.engine.strategy.registry import build_strategy


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _step(strategy, x) -> float:
    t0 = time.perf_counter()
    model = strategy.model
    model.backward(model(x).pow(2).mean(), num_items=x.shape[0])
    strategy.clip_grad_norm_(None)
    strategy.optimizer.step()
    strategy.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _worker(args) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(gs.rank())
    x = torch.randn(args.batch, args.width, generator=g)
    strategies = {d: build_strategy(_model(args.width, args.depth), "ddp", "fp32",
                                    torch.optim.SGD, sync=SyncOptions(
                                        compress=args.method, compress_delay=d, probe_every=0),
                                    lr=1e-3)
                  for d in (0, 1)}
    for s in strategies.values():
        for _ in range(3):
            _step(s, x)
    blocks: dict[int, list[float]] = {0: [], 1: []}
    for r in range(args.rounds):
        for d in ((0, 1) if r % 2 == 0 else (1, 0)):
            times = [_step(strategies[d], x) for _ in range(args.steps)]
            blocks[d].append(statistics.median(times) * 1e3)
            blocks.setdefault(10 + d, []).extend(times)
    for s in strategies.values():
        s.finish()
        s.reduction.close()
    return blocks


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
    mb = args.depth * (args.width * args.width + args.width) * 4 / 1e6
    print(f"{args.method}, MLP {args.depth}x{args.width} ({mb:.1f} MB of gradient), 2 ranks "
          f"gloo, {args.rounds} rounds x {args.steps} steps per delay, rank 0")
    for d in (0, 1):
        med = statistics.median(res[10 + d]) * 1e3
        blocks = ", ".join(f"{b:.1f}" for b in res[d])
        print(f"delay {d}: median {med:.1f} ms/step (block medians {blocks})")


if __name__ == "__main__":
    main()
