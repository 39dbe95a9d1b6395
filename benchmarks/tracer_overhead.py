"""What does the tracer cost? Tracer off vs no tracer code at all, and tracer on.

    PYTHONPATH=src python benchmarks/tracer_overhead.py [--rounds 12 --steps 8]

Three variants of DataParallel, and a control, train the same MLP on 2 gloo workers:

* ``none``: the engine with every tracer statement removed. Only two engine
  modules call the tracer on this path, ``engine/sync/core.py`` (the forward and
  backward spans, shared by every strategy) and
  ``engine/replicated/data_parallel.py`` (the wait for the buckets); both are
  rebuilt at run time from their own source by deleting, in the syntax tree,
  every statement that mentions the tracer, and the stripped DataParallel is
  built on the stripped core, so it is exactly today's engine minus tracing (each
  stripped source is checked to mention ``tracing`` only in its import). The
  other user of ``tracing``, ``train/step/train_step.py``'s optimizer span, is not on this
  path. ``comm``'s observer door stays: it is not tracer code (tests count
  collectives through it) and, with no observer, one empty-list check per
  collective, the same in every variant;
* ``off``: the shipped engine, no tracer active (the default);
* ``on``: the shipped engine with a Tracer recording every span and collective;
* ``none-b``: a second untraced copy, an A/A control: its distance from ``none``
  is what this machine's noise and model placement alone produce.

Timed blocks alternate (none, none-b, off, on, then rotated) inside one invocation, so
drift of a shared, noisy machine hits all variants alike; each block's median step
is taken and the medians of those are compared. Target: off costs < 2%.
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import json
import statistics
import sys
import time
import types

import torch

import gradsync as gs
from gradsync.engine.replicated import data_parallel
from gradsync.engine.sync import core
from gradsync.engine.transport import tracing

_TRACE_NAMES = {"tracing", "tracer", "t_wait"}


def _mentions_tracer(stmt: ast.stmt) -> bool:
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return False
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and node.id in _TRACE_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "_trace_t0":
            return True
    return False


class _Strip(ast.NodeTransformer):
    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = [s for s in stmts if not _mentions_tracer(s)]
                setattr(node, field, kept or [ast.Pass()])
        return node


def _untraced(module, imports: dict[str, str]) -> types.ModuleType:
    """``module`` compiled from its current source with every tracer statement deleted,
    registered as ``<package>._<name>_untraced``; ``imports`` maps a relative import's
    module (``..sync.core``) to the untraced module it should read instead."""
    tree = _Strip().visit(ast.parse(inspect.getsource(module)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            dotted = "." * node.level + (node.module or "")
            node.module = imports.get(dotted, node.module)
            node.level = 0 if dotted in imports else node.level
    source = ast.unparse(ast.fix_missing_locations(tree))
    leftover = [ln for ln in source.splitlines() if "tracing" in ln and "import" not in ln]
    assert not leftover, leftover
    package, _, name = module.__name__.rpartition(".")
    mod = types.ModuleType(f"{package}._{name}_untraced")
    mod.__package__ = package  # its relative imports resolve as the original's do
    sys.modules[mod.__name__] = mod
    exec(compile(source, f"<untraced {module.__name__}>", "exec"), mod.__dict__)
    return mod


def untraced_data_parallel():
    """DataParallel and the SyncedModule it extends, both compiled from the current
    source with every tracer statement deleted."""
    untraced_core = _untraced(core, {})
    return _untraced(data_parallel, {"..sync.core": untraced_core.__name__}).DataParallel


def _mlp(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _worker(a: dict) -> dict | None:
    base = _mlp(a["width"], a["depth"])
    untraced = untraced_data_parallel()
    variants = {
        "none": untraced(copy.deepcopy(base), bucket_cap_mb=a["bucket_mb"]),
        "none-b": untraced(copy.deepcopy(base), bucket_cap_mb=a["bucket_mb"]),
        "off": gs.DataParallel(copy.deepcopy(base), bucket_cap_mb=a["bucket_mb"]),
        "on": gs.DataParallel(copy.deepcopy(base), bucket_cap_mb=a["bucket_mb"]),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in variants.items()}
    x = torch.randn(a["batch"], a["width"], generator=torch.Generator().manual_seed(gs.rank()))
    tracer = tracing.Tracer(gs.rank())

    def step(kind: str) -> tuple[float, float]:
        dp, opt = variants[kind], opts[kind]
        t0, c0 = time.perf_counter(), time.thread_time()
        dp.backward(dp(x).square().mean(), num_items=a["batch"])
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, time.thread_time() - c0

    for kind in variants:  # warm-up, including the one bucket rebuild
        for _ in range(3):
            step(kind)
    order = list(variants)
    blocks: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a["rounds"]):
        k = r % len(order)
        for kind in order[k:] + order[:k]:
            if kind == "on":
                tracer.spans.clear()
                tracer.start()
            times, cpus = [], []
            for s in range(a["steps"]):
                if kind == "on":
                    tracer.begin_step(s)
                wall, c = step(kind)
                times.append(wall)
                cpus.append(c)
                if kind == "on":
                    tracer.end_step()
            if kind == "on":
                tracer.stop()
            blocks[kind].append(statistics.median(times))
            cpu[kind].append(statistics.median(cpus))
    return (blocks, cpu) if gs.rank() == 0 else None


def off_path_bound_s(steps_per_check: int = 1_000_000) -> float:
    """Seconds per step the off path can cost: its checks per synchronised step, timed alone.

    Per step the engine, tracer off, runs what ``checks`` runs: sync/core.py reads
    ``tracing.ACTIVE`` in the forward and at the start of backward and tests the
    backward's start time at its end; data_parallel.py calls ``wait_begins`` (one
    more read) and ``wait_ends`` around the wait for the buckets.
    """
    import timeit

    def checks():
        tracer = tracing.ACTIVE  # forward
        t0 = tracing.now() if tracer is not None else 0.0
        if tracer is not None:
            return t0
        trace_t0 = tracing.now() if tracing.ACTIVE is not None else None  # start of backward
        t_wait = tracing.wait_begins()  # the sync's wait for the buckets
        tracing.wait_ends(t_wait, buckets=1)
        if trace_t0 is not None and tracing.ACTIVE is not None:  # end of backward
            return trace_t0
        return None

    loop = timeit.timeit(lambda: None, number=steps_per_check)
    return max(0.0, timeit.timeit(checks, number=steps_per_check) - loop) / steps_per_check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="timed blocks per variant")
    p.add_argument("--steps", type=int, default=8, help="steps per block")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=1.0, help="small: many buckets, worst case")
    p.add_argument("--workers", type=int, default=2)
    a = vars(p.parse_args())
    blocks, cpu = gs.spawn(_worker, a.pop("workers"), a)[0]
    med = {k: statistics.median(v) for k, v in blocks.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"rank 0, median of {a['rounds']} block medians of {a['steps']} steps; wall = step "
          "time, cpu = the training thread's CPU time (immune to other jobs' load)")
    print(f"{'variant':8} {'wall':>10} {'vs none':>9} {'cpu':>10} {'vs none':>9}")
    for k in ("none", "none-b", "off", "on"):
        print(f"{k:8} {med[k] * 1e3:7.2f} ms {med[k] / med['none'] - 1:+8.2%} "
              f"{cmed[k] * 1e3:7.2f} ms {cmed[k] / cmed['none'] - 1:+8.2%}")
    bound = off_path_bound_s()
    print(f"off-path checks alone: {bound * 1e9:.0f} ns per step = "
          f"{bound / med['none']:.5%} of a step (what off adds; block medians differ by noise)")
    print(json.dumps({"median_step_s": med, "off_vs_none": med["off"] / med["none"],
                      "aa_control": med["none-b"] / med["none"],
                      "on_vs_none": med["on"] / med["none"], "off_path_bound_s": bound,
                      "cpu_s": cmed, "cpu_off_vs_none": cmed["off"] / cmed["none"],
                      "args": a}))


if __name__ == "__main__":
    main()
