"""The worked example's task: a noisy tanh regression, y = tanh(X w*) + 0.05 eps.

``gradsync verify`` trains on it (N=4096, d=16; K replicas vs one process, drift 0,
gap at machine epsilon, final loss 0.179049), so the data must be drawn exactly as
the NumPy reference draws it: ``numpy.random.default_rng(7)``, then X, then
w_star, then the noise, in that order. Any change in draw order changes every
number.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


def make_regression(
    n: int = 4096, d: int = 16, seed: int = 7, noise: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(X, y)`` as float64 tensors of shapes ``(n, d)`` and ``(n, 1)``.

    ``y = tanh(X @ w_star) + noise * eps`` with X, w_star, eps standard normal,
    drawn in that order (X, w_star, eps) from one generator.
    """
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    w_star = rng.standard_normal((d, 1))
    y = np.tanh(X @ w_star) + noise * rng.standard_normal((n, 1))
    return torch.from_numpy(X), torch.from_numpy(y)


class RegressionDataset(Dataset):
    """Indexable ``(x_i, y_i)`` pairs over the regression tensors."""

    def __init__(self, X: torch.Tensor | None = None, y: torch.Tensor | None = None, **kw):
        if X is None or y is None:
            X, y = make_regression(**kw)
        if len(X) != len(y):
            raise ValueError(f"X has {len(X)} rows but y has {len(y)}")
        self.X, self.y = X, y

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.X[i], self.y[i]
