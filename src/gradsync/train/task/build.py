"""What a run trains: the model, its data (training and held-out), the loss, what an item is.

An *item* is what the loss averages over: a token for a language model (so the
gradient is the exact mean over every target token of the global batch), a
sample otherwise. The built-in models and datasets, and the user's own through
``--model pkg.module:factory`` / ``--data pkg.module:factory``, all end up as one
:class:`Task`.

The factories' contracts (also in docs/train.md and ``examples/``):

* model factory: ``factory() -> torch.nn.Module``, no arguments (the same
  contract as ``gradsync plan memory MODEL`` and ``gradsync calibrate``). It
  runs on every worker after ``torch.manual_seed(--seed)``; the engine then
  broadcasts rank 0's values, so every replica starts identical anyway. The
  module's own dtype is kept (``--precision fp32`` means "no mixed precision").
* data factory: ``factory() -> Dataset | TrainData``, no arguments. A plain
  map-style Dataset yields ``(input, target)`` pairs; the loss is then
  cross-entropy over the last dimension when targets are integers (items = target
  elements other than -100; -100 marks padding, as in ``F.cross_entropy`` and
  transformers; throughput names them tokens when a sample's target is a sequence,
  samples when it is one class label) and mean squared error otherwise (items =
  samples). A :class:`TrainData` says it all explicitly and may carry a held-out set.
* inputs: a tensor is passed as ``model(input)``; a dict (``{"input_ids": ...,
  "attention_mask": ...}``) as ``model(**input)``. Samples are batched with torch's
  ``default_collate`` unless a ``collate_fn`` is given. A sample may also be a dict
  with ``"labels"`` (transformers' layout) and a ``collate_fn`` may return one; the
  default losses read a ModelOutput through ``logits`` and a tuple as ``(logits,
  ...)`` (``conventions.py`` has the rules, including the causal-LM shift when
  ``labels`` equal ``input_ids``). Other targets are used as given: for a causal LM
  in ``(input, target)`` pairs they are the *next* tokens (shifted by the data).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ...errors import UsageError
from ...factory import factory_name, is_factory_spec, load_factory
from ...models import build_model
from ..config.run_config import RunConfig
from .builtins import DATASETS, split_held_out
from .conventions import IGNORE_INDEX, causal_lm_layout, labelled, shifted_lm_loss
from .conventions import loss_input as _logits
from .conventions import shifted_token_items as _shifted_token_items
from .conventions import stack as _stack
from .eval_metrics import check_metrics
from .optim import optimizer_factory, scheduler_factory
from .recompute import checkpoint_blocks


@dataclass
class TrainData:
    """What a ``--data`` factory may return.

    Args:
        train: map-style dataset of ``(input, target)`` pairs.
        eval: held-out dataset, evaluated every ``--eval-every`` steps (None: no eval).
        loss_fn: ``(output, target) -> loss``, the *mean* over the micro-batch's items.
        items_fn: ``(input, target) -> int``, how many items that mean is over.
        collate_fn: ``list of (input, target) -> (inputs, targets)`` (default: stack).
        item_name: what an item is, for throughput ("tokens", "samples").
        metrics: ``{name: fn(output, target) -> (sum, count)}``, evaluated on ``eval``
            beside the held-out loss: sums and counts are added over every held-out
            batch of every rank, and ``sum / count`` is reported (``eval_metrics.py``).
        tokenizer: what made the tokens (a transformers tokenizer, anything with
            ``save_pretrained``): ``gradsync export --format hf --data`` saves it beside
            the model. Training never reads it.
    Missing loss/items follow the target dtype (see the module docstring).
    """

    train: Dataset
    eval: Dataset | None = None
    loss_fn: Callable | None = None
    items_fn: Callable | None = None
    collate_fn: Callable | None = None
    item_name: str | None = None
    metrics: Mapping[str, Callable] | None = None
    tokenizer: object | None = None


@dataclass
class Task:
    model: nn.Module
    data: TrainData
    optimizer_factory: Callable  # (param_groups, lr) -> Optimizer (train/task/optim.py)
    scheduler_factory: Callable | None  # (optimizer, total_steps) -> LRScheduler; None: built-in
    model_name: str
    data_name: str

    def collate(self, dataset: Dataset, indices: list[int]):
        return self.data.collate_fn([dataset[i] for i in indices])

    def items(self, x, y) -> int:
        return int(self.data.items_fn(x, y))


def _lm_loss(output, targets):
    """The mean over every target that is not IGNORE_INDEX (integer targets of any
    width: labels from numpy are often int32)."""
    logits = _logits(output)
    if targets.dtype == torch.bool:
        raise UsageError("boolean targets: give class indices (integers) or float targets")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(),
                           ignore_index=IGNORE_INDEX)


def _mse_loss(output, targets):
    pred = _logits(output)
    if pred.shape != targets.shape:
        if pred.numel() == targets.numel() and pred.shape[:1] == targets.shape[:1]:
            pred = pred.reshape(targets.shape)  # (N, 1) against (N,): the same values
        else:  # broadcasting would silently train on every pair of rows
            raise UsageError(f"the model's output has shape {tuple(pred.shape)} and the "
                             f"targets {tuple(targets.shape)}: the default mean squared error "
                             "needs the same shape (or give TrainData a loss_fn)")
    return F.mse_loss(pred, targets)


def _token_items(x, y) -> int:
    return int((y != IGNORE_INDEX).sum())


def _sample_items(x, y) -> int:
    return int(y.shape[0])


def builtin_data(name: str, cfg: RunConfig) -> TrainData:
    if name not in DATASETS:
        raise UsageError(f"unknown data {name!r}; choose from {', '.join(DATASETS)}")
    train, held = split_held_out(DATASETS[name][1](cfg.run.seq_len, cfg.run.seed))
    return complete(TrainData(train, held))


def complete(data: TrainData | Dataset) -> TrainData:
    """Fill what a TrainData left out from its first sample's target dtype."""
    if not isinstance(data, TrainData):
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise UsageError(f"a data factory must return a map-style Dataset or a "
                             f"gradsync.TrainData, got {type(data).__name__}")
        data = TrainData(data)
    if len(data.train) < 1:
        raise UsageError("the training dataset is empty")
    collate = _stack if data.collate_fn is None else labelled(data.collate_fn)
    if data.loss_fn is None or data.items_fn is None or data.item_name is None:
        x, y = collate([data.train[0]])
        integer = not torch.is_floating_point(y)
        if integer and causal_lm_layout(x, y):  # transformers' labels == input_ids: shift
            data.loss_fn = data.loss_fn or shifted_lm_loss
            data.items_fn = data.items_fn or _shifted_token_items
        data.loss_fn = data.loss_fn or (_lm_loss if integer else _mse_loss)
        data.items_fn = data.items_fn or (_token_items if integer else _sample_items)
        # integer targets, one per sample (classification): the items are samples;
        # a sequence of them per sample (language modelling): tokens
        data.item_name = data.item_name or ("tokens" if integer and y.dim() > 1 else "samples")
    data.collate_fn = collate
    check_metrics(data.metrics, data.eval)
    return data


def _refuse_meta(model: nn.Module, name: str) -> None:
    """A tensor on the meta device has a shape and no values: name it, before torch's
    "Cannot copy out of meta tensor; no data!" (which names nothing) when it is moved."""
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        bad = [n for n, t in items if t.is_meta]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise UsageError(f"--model {name}: {kind} {bad[0]!r}{more} is on the meta device "
                             "(a shape, no values), so it cannot be trained; give it real values "
                             "in the factory (e.g. module.to_empty(device='cpu'), then "
                             "initialise it, or load a state dict with assign=True)")


def build_task(cfg: RunConfig, model_fn: Callable | None = None,
               data_fn: Callable | None = None,
               factories: Mapping[str, Callable] | None = None) -> Task:
    """Model (seeded identically on every rank), data, loss, items and optimizer.
    ``factories``: ``--optimizer``/``--scheduler`` given from Python as functions, by the
    name the config records (``launcher/api.take_factories``)."""
    torch.manual_seed(cfg.run.seed)
    run = cfg.run
    model_fn = model_fn or (load_factory(run.model) if is_factory_spec(run.model) else None)
    if model_fn is not None:
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise UsageError(f"model factory {factory_name(model_fn)} returned "
                             f"{type(model).__name__}, not a torch.nn.Module")
    elif cfg.run.model == "gpt":  # its blocks checkpoint themselves (models/gpt.py)
        model = build_model("gpt", seq_len=cfg.run.seq_len,
                            checkpoint_activations=cfg.task.activation_checkpointing)
    else:
        model = build_model(cfg.run.model)
    if cfg.task.activation_checkpointing and cfg.run.model != "gpt":
        checkpoint_blocks(model, cfg.run.model)  # per block, names unchanged (recompute.py)
    _refuse_meta(model, cfg.run.model)
    data_fn = data_fn or (load_factory(cfg.run.data) if is_factory_spec(cfg.run.data) else None)
    data = complete(data_fn()) if data_fn is not None else builtin_data(cfg.run.data, cfg)
    return Task(model, data, optimizer_factory(cfg, factories),
                scheduler_factory(cfg, factories), run.model, run.data)

