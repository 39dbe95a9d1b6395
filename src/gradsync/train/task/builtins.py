"""The built-in datasets and optimizers of `gradsync train`, by name: the registries the
CLI's choices (``--data``, ``--optimizer``) are derived from. The built-in optimizers
are factories with the same contract as the user's own (``optim.py``).

Every built-in dataset holds out its last :data:`HELD_OUT` samples (or a
twentieth, if smaller) for ``--eval-every``. The number is fixed, not a flag, so
switching evaluation on or off never changes what is trained on (a resumed run
may do either).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Dataset, Subset

from ...data import TokenWindows, random_tokens, stdlib_tokens

TEACHER_SAMPLES = 4096
HELD_OUT = 128


class TeacherRegression(Dataset):
    """Inputs ~ N(0, 1) and targets from a fixed random 'teacher' layer: learnable, offline."""

    def __init__(self, n: int, width: int, seed: int):
        g = torch.Generator().manual_seed(seed + 12345)
        teacher = torch.randn(width, width, generator=g) / width**0.5
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.tanh(self.x @ teacher)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def split_held_out(dataset: Dataset) -> tuple[Dataset, Dataset | None]:
    n = len(dataset)
    held = min(HELD_OUT, n // 20)
    if held < 1:
        return dataset, None
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))


DATASETS: dict[str, tuple[str, Callable[[int, int], Dataset]]] = {
    "pysrc": ("Python standard library sources as tokens (offline)",
              lambda seq_len, seed: TokenWindows(stdlib_tokens().long(), seq_len)),
    "random-tokens": ("uniform random tokens (benchmarking)",
                      lambda seq_len, seed: TokenWindows(random_tokens(2_000_000, seed=seed),
                                                         seq_len)),
    "teacher": ("regression on a fixed random teacher layer",
                lambda seq_len, seed: TeacherRegression(TEACHER_SAMPLES + HELD_OUT, 1024, seed)),
}
"""name -> (what it is, builder(seq_len, seed) -> the whole dataset, held-out part included)."""

DATA_FOR_MODEL = {"gpt": ("pysrc", "random-tokens"), "mlp": ("teacher",)}
DEFAULT_DATA = {"gpt": "pysrc", "mlp": "teacher"}

def adamw(param_groups, lr: float) -> torch.optim.Optimizer:
    """AdamW as GPT-2/nanoGPT train: betas 0.9/0.95, decoupled weight decay 0.1 (on the
    ``decay`` group only: ``optim.py`` gives the ``no_decay`` group 0)."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def sgd(param_groups, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, no weight decay unless ``--weight-decay`` is given."""
    return torch.optim.SGD(param_groups, lr=lr, momentum=0.9)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": adamw, "sgd": sgd}
"""name -> factory(param_groups, lr) -> optimizer: the contract of ``--optimizer
pkg.module:factory`` (``optim.py``); the group options the flags set win over these
defaults. adamw: the built-in GPT's recipe; sgd: the mlp demo's."""
