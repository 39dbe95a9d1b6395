"""What each built-in model trains on, and how its loss and item count are computed.

An "item" is what the loss averages over: a token for the language model (so the
gradient is the exact mean over every target token of the global batch) and a
sample for the regression MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..data import TokenWindows, random_tokens, stdlib_tokens
from ..errors import UsageError
from ..models import build_model
from .config import TrainConfig

TEACHER_SAMPLES = 4096


class TeacherRegression(Dataset):
    """Inputs ~ N(0, 1) and targets from a fixed random 'teacher' layer: learnable, offline."""

    def __init__(self, n: int, width: int, seed: int):
        g = torch.Generator().manual_seed(seed + 12345)
        self.x = torch.randn(n, width, generator=g)
        teacher = torch.randn(width, width, generator=g) / width**0.5
        self.y = torch.tanh(self.x @ teacher)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@dataclass
class Task:
    model: torch.nn.Module
    dataset: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    items_per_sample: int
    tokens_per_sample: int


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def dataset_for(cfg: TrainConfig) -> Dataset:
    if cfg.data == "pysrc":
        return TokenWindows(stdlib_tokens().long(), cfg.seq_len)
    if cfg.data == "random-tokens":
        return TokenWindows(random_tokens(2_000_000, seed=cfg.seed), cfg.seq_len)
    return TeacherRegression(TEACHER_SAMPLES, 1024, cfg.seed)


def build_task(cfg: TrainConfig) -> Task:
    """Model (seeded identically on every rank), dataset, loss and item accounting."""
    torch.manual_seed(cfg.seed)
    dataset = dataset_for(cfg)
    if cfg.model == "gpt":
        model = build_model("gpt", seq_len=cfg.seq_len)
        return Task(model, dataset, _lm_loss, cfg.seq_len, cfg.seq_len)
    if cfg.model == "mlp":
        model = build_model("mlp")
        return Task(model, dataset, F.mse_loss, 1, 0)
    raise UsageError(f"unknown model {cfg.model!r}")


def collate(dataset: Dataset, indices: list[int]):
    xs, ys = zip(*(dataset[i] for i in indices))
    return torch.stack(xs), torch.stack(ys)
