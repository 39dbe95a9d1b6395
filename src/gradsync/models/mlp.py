"""MLPs: the worked example's two-layer tanh regressor and the benchmark's deep GELU MLP."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class TanhMLP(nn.Module):
    """``Linear(d_in, hidden) -> tanh -> Linear(hidden, d_out)``.

    ``gradsync verify`` trains exactly this network (d=16, H=32, N=4096, K=8
    workers, 200 full-batch SGD steps, lr 0.02); ``from_reference_init`` draws
    the weights as a plain NumPy implementation of that example does, so the
    results can be compared number for number with it (final loss 0.179049).
    """

    def __init__(self, d_in: int, hidden: int, d_out: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    @classmethod
    def from_reference_init(
        cls, d: int = 16, H: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0
    ) -> TanhMLP:
        """Initialise as the NumPy reference: ``default_rng(seed)``, W1 then W2, times 0.1.

        The reference computes ``x @ W1`` with ``W1`` of shape ``(d, H)``; nn.Linear
        computes ``x @ weight.T``, so ``weight = W1.T``. Biases start at zero.
        """
        g = np.random.default_rng(seed)
        W1 = g.standard_normal((d, H)) * 0.1
        W2 = g.standard_normal((H, 1)) * 0.1
        model = cls(d, H, 1).to(dtype)
        with torch.no_grad():
            model.fc1.weight.copy_(torch.from_numpy(W1.T.copy()))
            model.fc1.bias.zero_()
            model.fc2.weight.copy_(torch.from_numpy(W2.T.copy()))
            model.fc2.bias.zero_()
        return model


class DeepMLP(nn.Module):
    """``depth`` x (Linear(width, width) + GELU): the "8x(1024x1024)+GELU MLP".

    The benchmarks' "mlp" (``benchmarks/ddp_vs_torch.py``, ``autotune.py``,
    ``slow_link.py``): many equal, large parameters make the all-reduce volume
    (about 34 MB at the defaults) comparable to compute on CPU, which is where
    bucketing and overlap show up in step time.
    """

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        if width < 1 or depth < 1:
            raise ValueError(f"width and depth must be >= 1, got width={width}, depth={depth}")
        self.width, self.depth = width, depth
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
