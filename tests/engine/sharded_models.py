"""The stage-3 test model: root-owned input and head layers around wrapped blocks.

Shared by the FSDP, strategy, sharded-checkpoint, hierarchical and rule-5 parity
tests, so each wraps the same units (``wrap={Block}``).
"""

import torch
from torch import nn

from tests.helpers import D_IN, D_OUT


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class Net(nn.Module):
    """Root-owned input and head layers around two wrapped blocks (float64)."""

    def __init__(self, hidden=10, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(D_IN, hidden)
        self.blocks = nn.Sequential(Block(hidden), Block(hidden))
        self.head = nn.Linear(hidden, D_OUT)
        self.double()

    def forward(self, x):
        return self.head(self.blocks(torch.tanh(self.inp(x))))
