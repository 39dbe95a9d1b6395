"""Tiny models for calibration tests, importable by name in spawned workers."""

import torch
from torch import nn


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


class Tied(nn.Module):
    """Embedding and output head share one weight: it must be counted once."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x))))


def tied():
    return Tied()


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def unused():
    return Unused()


def not_a_module():
    return 42
