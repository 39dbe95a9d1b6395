"""Your own model and data under `gradsync train`: two factories, nothing else.

From the repository root:

    gradsync train --model examples.user_model:build_model \\
                   --data examples.user_model:build_data --steps 200 --out runs/mine

or from Python (this file): ``python examples/user_model.py``.

The contracts:

* ``build_model() -> torch.nn.Module``, no arguments. It runs on every worker
  after ``torch.manual_seed(--seed)``; the engine broadcasts rank 0's values, so
  every replica starts identical. The same factory works for ``gradsync plan
  memory --model`` and ``gradsync calibrate --model``.
* ``build_data() -> Dataset | gradsync.TrainData``, no arguments. A plain
  map-style Dataset yields ``(input, target)`` tensor pairs; the loss is then
  cross-entropy for integer targets (items = target elements, e.g. tokens) and
  mean squared error for float targets (items = samples). ``TrainData`` says it
  explicitly -- the loss (a *mean* over the micro-batch's items), how many items
  a micro-batch holds, and a held-out set evaluated every ``--eval-every`` steps.

What comes with it: the exact gradient over the global batch (``backward(loss,
num_items=n)``), accumulation, checkpoints that continue on any number of
workers, NaN guards, metrics.jsonl and report.html.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradsync as gs

FEATURES, CLASSES = 20, 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, CLASSES))


def _blobs(n: int, seed: int):
    """Four overlapping Gaussian blobs: learnable, but not perfectly."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) / 2
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return centers[labels] + torch.randn(n, FEATURES, generator=g), labels


def build_data() -> gs.TrainData:
    return gs.TrainData(
        train=TensorDataset(*_blobs(4096, seed=1)),
        eval=TensorDataset(*_blobs(512, seed=2)),  # held out: never trained on
        loss_fn=F.cross_entropy,  # the mean over the micro-batch's samples
        items_fn=lambda x, y: len(x),  # ... so an item is a sample
        item_name="samples",
    )


if __name__ == "__main__":
    # Launches 2 local workers; run it again and it continues where it stopped.
    summary = gs.train(gs.TrainConfig(workers=2, steps=200, global_batch=64, micro_batch=16,
                                      lr=1e-2, eval_every=50, out="runs/user_model"),
                       model=build_model, data=build_data)
    if summary:
        print(f"final loss {summary['final_loss']:.4f}, held-out {summary['final_eval_loss']:.4f}")
