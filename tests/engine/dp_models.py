"""The model and training run shared by ``test_dp_features.py`` and ``test_dp_errors.py``."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradsync as gs
from tests.helpers import D_IN, D_OUT, dataset, dp_train, even_schedule


class Shuffled(nn.Module):
    """Layers used in a different order than they were registered."""

    def __init__(self, frozen=False, unused=False, ckpt=False):
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Linear(8, 8)
        self.head = nn.Linear(8, D_OUT)
        self.b = nn.Linear(8, 8)
        self.inp = nn.Linear(D_IN, 8)
        self.c = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.unused, self.ckpt = unused, ckpt
        if frozen:
            self.b.requires_grad_(False)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.c(h))
        if self.ckpt:
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=False)
        else:
            h = torch.tanh(self.b(h))
        h = torch.tanh(self.a(h))
        if not self.unused:
            h = h + 0.1 * torch.tanh(self.spare(h))
        return self.head(h)


SCHED = even_schedule(6, 2, per_rank=12, n=96)


def run_dp(factory, schedule, opt="sgd", find_unused=False, cap=0.0002):
    """This rank's side of ``schedule``: parameters, bucket plan, parameter names."""
    x, y = dataset()
    dp = gs.DataParallel(
        factory(), bucket_cap_mb=cap, first_bucket_mb=cap, find_unused_parameters=find_unused
    )
    params = dp_train(dp, opt, schedule, x, y, gs.rank())
    return {"params": params, "plan": dp.bucket_plan, "names": [s.name for s in dp.param_specs]}


def frozen_factory():
    return Shuffled(frozen=True)


def reordered_factory():
    return Shuffled()


def ckpt_factory():
    return Shuffled(ckpt=True)


def unused_factory():
    return Shuffled(unused=True)
