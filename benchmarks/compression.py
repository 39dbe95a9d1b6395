"""Compressed all-reduce of the built-in models' gradient buckets: bytes, time, error.

Usage: PYTHONPATH=src python benchmarks/compression.py [--models gpt mlp] [--world 2] [--rounds 5]

For each model, the trainable parameters are bucketed as DataParallel does
(``engine/bucketing.plan_buckets``, 25 MiB buckets, 1 MiB first bucket) and one
real gradient per rank (a backward on random data) is reduced bucket by bucket:

* ``exact``: ``comm.all_reduce`` in float32 (what DataParallel runs today);
* ``torch bf16``: cast to bf16, gloo all-reduce in bf16, cast back: the method of
  torch's ``bf16_compress_hook`` (sums rounded to bf16 at every hop);
* gradsync's ``bf16``, ``fp16``, ``int8``, ``powersgd:1`` and ``powersgd:4``.

Columns: bytes this rank sent per step (``CompressionStats``), ratio against the
exact all-reduce, ms per step (median of ``--rounds`` alternating rounds; the
compressors' CPU work included), and the distance of the result from the exact
sum (cosine, relative error) on the first step; PowerSGD's after 4 warm-started
steps on the same gradient, since its first step starts from a random Q.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.engine.buckets.plan import ParamSpec, mb_to_bytes, plan_buckets
from gradsync.engine.compress import gradient_distance, parse_compression
from gradsync.engine.transport import comm
from gradsync.models import build_model

METHODS = ["exact", "torch bf16", "bf16", "fp16", "int8", "powersgd:1", "powersgd:4"]


def _gradients(name: str, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(name)
    g = torch.Generator().manual_seed(100 + rank)
    if name == "gpt":
        idx = torch.randint(0, model.cfg.vocab_size, (8, model.cfg.seq_len + 1), generator=g)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    else:
        x = torch.randn(64, model.width, generator=g)
        loss = model(x).pow(2).mean()
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def _buckets(grads):
    specs = [ParamSpec(f"p{i}", g.numel(), g.element_size()) for i, g in enumerate(grads)]
    plan = plan_buckets(specs, mb_to_bytes(25), mb_to_bytes(1))
    return [(b.index, [grads[i].shape for i in b.params],
             torch.cat([grads[i].reshape(-1) for i in b.params])) for b in plan]


def _step(method, compressor, buckets):
    for key, shapes, flat in buckets:
        x = flat.clone()
        if method == "exact":
            comm.all_reduce(x)
        elif method == "torch bf16":
            half = x.to(torch.bfloat16)
            comm.all_reduce(half)
            x.copy_(half)
        else:
            compressor.all_reduce_(key, x, shapes)
    return x


def worker(models, rounds):
    rows = []
    for name in models:
        buckets = _buckets(_gradients(name, dist.get_rank()))
        exact = []
        for _, _, flat in buckets:
            x = flat.clone()
            comm.all_reduce(x)
            exact.append(x)
        # distance first, on fresh compressors
        dist_of = {}
        for m in METHODS:
            c = parse_compression(m) if m not in ("exact", "torch bf16") else None
            outs = []
            for key, shapes, flat in buckets:
                for _ in range(4 if m.startswith("powersgd") else 1):
                    x = flat.clone()
                    if c is None:
                        half = x.to(torch.bfloat16) if m == "torch bf16" else x
                        comm.all_reduce(half)
                        x.copy_(half)
                    else:
                        c.all_reduce_(key, x, shapes)
                outs.append(x)
            dist_of[m] = gradient_distance(outs, exact)
        comps = {m: parse_compression(m) for m in METHODS if m not in ("exact", "torch bf16")}
        times = {m: [] for m in METHODS}
        for _ in range(rounds):
            for m in METHODS:
                dist.barrier()
                t0 = time.perf_counter()
                _step(m, comps.get(m), buckets)
                times[m].append(time.perf_counter() - t0)
        world = dist.get_world_size()
        raw = sum(f.numel() * f.element_size() for _, _, f in buckets)
        exact_sent = 2 * (world - 1) * raw // world
        for m in METHODS:
            if m == "exact":
                sent = exact_sent
            elif m == "torch bf16":
                sent = exact_sent // 2
            else:
                st = comps[m].stats()
                sent = st.sent_bytes // st.calls * len(buckets)
            rows.append((name, len(buckets), raw, m, sent, exact_sent / sent,
                         statistics.median(times[m]) * 1e3, *dist_of[m]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["gpt", "mlp"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    rows = gs.spawn(worker, a.world, a.models, a.rounds)[0]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{a.world} ranks, gloo, per step (all buckets); "
                        f"ms: median of {a.rounds} alternating rounds")
    for col in ("model", "buckets", "MB", "method", "sent MB/rank", "ratio", "ms",
                "cosine", "rel. error"):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    for name, nb, raw, m, sent, ratio, ms, cos, rel in rows:
        table.add_row(name, str(nb), f"{raw / 2**20:.2f}", m, f"{sent / 2**20:.3f}",
                      f"{ratio:.2f}", f"{ms:.1f}", f"{cos:.6f}", f"{rel:.2e}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
