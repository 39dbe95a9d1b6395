"""Factories for the module:factory tests."""

import torch.nn as nn


def tiny_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def not_a_module():
    return 42


def raises():
    raise RuntimeError("boom")
