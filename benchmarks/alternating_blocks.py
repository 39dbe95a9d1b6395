"""Shared pieces of the step-time benchmarks that compare strategies inside one process
group: an MLP, a timed training step, and alternating timed blocks.

Two settings timed in alternating blocks (A then B, then B then A, ...) see the same
machine drift; a step is rank 0's wall time from forward to ``zero_grad``, the
training loop's shape. Used by ``compress_delay.py`` and ``collectives_auto.py``.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def mlp(width: int, depth: int) -> nn.Module:
    """``depth`` x Linear(width, width) with GELU after each, the same weights every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def mlp_megabytes(width: int, depth: int) -> float:
    """The MLP's float32 gradient in MB."""
    return depth * (width * width + width) * 4 / 1e6


def timed_step(strategy, x: torch.Tensor, clip: bool = False) -> float:
    """One step of ``strategy`` on ``x`` (loss = mean square of the output), in seconds;
    ``clip`` adds the gradient-norm measurement the training loop makes."""
    t0 = time.perf_counter()
    model = strategy.model
    model.backward(model(x).pow(2).mean(), num_items=x.shape[0])
    if clip:
        strategy.clip_grad_norm_(None)
    strategy.optimizer.step()
    strategy.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def alternate(strategies: dict, x: torch.Tensor, rounds: int, steps: int,
              warmup: int = 3, clip: bool = False) -> dict:
    """Time every strategy in alternating blocks of ``steps`` steps, ``rounds`` times,
    after ``warmup`` untimed steps each; the order flips every round. Returns
    ``{"blocks": {key: [block median ms]}, "times": {key: [step s]}}``."""
    keys = list(strategies)
    for s in strategies.values():
        for _ in range(warmup):
            timed_step(s, x, clip)
    out: dict = {"blocks": {k: [] for k in keys}, "times": {k: [] for k in keys}}
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            times = [timed_step(strategies[k], x, clip) for _ in range(steps)]
            out["blocks"][k].append(statistics.median(times) * 1e3)
            out["times"][k].extend(times)
    return out


def summary_lines(out: dict, label=str) -> list[str]:
    """One line per setting: its median over every step and each block's median."""
    lines = []
    for k, times in out["times"].items():
        blocks = ", ".join(f"{b:.1f}" for b in out["blocks"][k])
        lines.append(f"{label(k)}: median {statistics.median(times) * 1e3:.1f} ms/step "
                     f"(block medians {blocks})")
    return lines
