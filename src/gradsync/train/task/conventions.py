"""How a sample and a model's output are read: the layouts users bring from torch and transformers.

Samples (what a dataset's ``__getitem__`` returns), batched by ``stack``:

* an ``(input, target)`` pair, batched with torch's ``default_collate``;
* a dict with ``"labels"`` -- transformers' layout (``{"input_ids", "attention_mask",
  ..., "labels"}``): the input is the dict without ``"labels"`` (the model is called
  as ``model(**input)``) and the target is ``"labels"``. gradsync computes the loss
  itself, so that every rank counts exactly the items its mean is over, and never
  passes ``labels`` to the model. ``"label"`` (a datasets classification column,
  which transformers' data collators rename to ``"labels"``) is read the same way.

  transformers' causal LMs are given ``labels`` equal to ``input_ids`` and shift
  inside the model. Fed to the loss as given, such labels would train the model to
  copy its input, so when a sample's labels equal its ``input_ids`` wherever they
  are not -100 (:func:`causal_lm_layout`, decided once on the first sample) the
  default loss shifts as transformers does: the logits at position t are scored
  against the label at t + 1, the last position against nothing, and the items are
  the shifted labels other than -100. Labels that differ from ``input_ids`` (token
  or sequence classification, or next tokens the data already shifted) are used as
  given.
* any other dict is refused naming ``"labels"``; anything else naming the pair.

Outputs (what the default losses read through :func:`logits`): a tensor as it is; a
transformers ``ModelOutput`` or a dict through ``"logits"``; a tuple or list
(``return_dict=False``, and many hand-written models return ``(logits, aux)``)
through its first element, which must be a tensor -- otherwise one line naming the
fix, never ``'tuple' object has no attribute 'reshape'``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from ...errors import UsageError

IGNORE_INDEX = -100
"""A target that is not an item: F.cross_entropy's default ``ignore_index`` (padding)."""

LABELS = "labels"
LABEL_KEYS = (LABELS, "label")  # "label": renamed to "labels" by transformers' collators


def loss_input(output):
    """:func:`logits`, in fp32 when the model computed in fp16: a default loss reduces in
    fp32 (arXiv 1710.03740, section 3.3), and with loss scaling the gradient reaching
    an fp16 loss (items x scale) would overflow fp16 itself."""
    out = logits(output)
    return out.float() if out.dtype == torch.float16 else out


def logits(output):
    """The tensor a default loss reads from ``output`` (see the module docstring)."""
    if isinstance(output, Mapping):
        if "logits" not in output:
            raise UsageError(f"the model returned a dict with keys {sorted(output)}; the default "
                             "loss reads 'logits': return it, or give TrainData a loss_fn")
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        first = output[0] if output else None
        if not isinstance(first, torch.Tensor):
            what = "an empty " + type(output).__name__ if not output else (
                f"a {type(output).__name__} whose first element is a {type(first).__name__}")
            raise UsageError(f"the model returned {what}; the default loss reads a tuple as "
                             "(logits, ...): return the logits first (or alone), or give "
                             "gradsync.TrainData a loss_fn(output, target)")
        return first
    if not isinstance(output, torch.Tensor):
        raise UsageError(f"the model returned a {type(output).__name__}; the default loss needs "
                         "a tensor of logits (or an output with .logits, or a tuple with them "
                         "first): return one, or give gradsync.TrainData a loss_fn")
    return output


def stack(samples):
    """A list of samples -> ``(inputs, targets)``: pairs, or dicts with ``"labels"``."""
    first = samples[0]
    if isinstance(first, Mapping):
        if not any(k in first for k in LABEL_KEYS):
            raise UsageError(f"a training sample is a dict with keys {sorted(first)} and no "
                             f"'{LABELS}'; add the targets as '{LABELS}' (transformers' layout), "
                             "return (input, target) pairs, or give gradsync.TrainData a "
                             "collate_fn that builds (inputs, targets)")
        try:  # lists (a datasets row without set_format("torch")) become tensors first
            batch = default_collate([{k: torch.as_tensor(v) if isinstance(v, (list, tuple))
                                      else v for k, v in s.items()} for s in samples])
        except RuntimeError as e:
            raise UsageError(f"the samples' tensors differ in size and cannot be stacked ({e}); "
                             "pad them to one length in the dataset, or give gradsync.TrainData "
                             "a collate_fn that pads (it may return a dict with "
                             f"'{LABELS}')") from None
        return split_labels(batch)
    if not (isinstance(first, (tuple, list)) and len(first) == 2):
        raise UsageError(f"a training sample must be an (input, target) pair or a dict with "
                         f"'{LABELS}', got a {type(first).__name__}; return one of those from "
                         "the dataset, or give gradsync.TrainData a collate_fn that builds "
                         "(inputs, targets)")
    x, y = default_collate(samples)
    return x, y


def split_labels(batch):
    """A collated dict with ``"labels"`` (a transformers data collator's output) ->
    ``(inputs, labels)``; anything else is returned as it is (an (inputs, targets) pair)."""
    if not isinstance(batch, Mapping):
        return batch
    key = next((k for k in LABEL_KEYS if k in batch), None)
    if key is None:
        return batch
    inputs = {k: v for k, v in batch.items() if k != key}
    if not inputs:
        raise UsageError(f"a batch holds only '{key}': the model needs inputs beside them "
                         "(e.g. 'input_ids')")
    return inputs, batch[key]


def labelled(collate_fn):
    """A user's ``collate_fn`` whose dict-with-labels result is split like a sample's."""
    def collate(samples):
        batch = split_labels(collate_fn(samples))
        if isinstance(batch, Mapping):
            raise UsageError(f"the collate_fn returned a dict with keys {sorted(batch)} and no "
                             f"'{LABELS}': return (inputs, targets), or the dict with the "
                             f"targets as '{LABELS}'")
        return batch
    collate.__wrapped__ = collate_fn
    return collate


def causal_lm_layout(x, y) -> bool:
    """Labels equal to ``input_ids`` wherever they are not -100: transformers' causal-LM
    layout, where the model (here: the loss) shifts (see the module docstring)."""
    ids = x.get("input_ids") if isinstance(x, Mapping) else None
    if not isinstance(ids, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    if torch.is_floating_point(y) or y.shape != ids.shape or y.dim() < 2:
        return False
    real = y != IGNORE_INDEX
    return bool(real.any()) and bool((y[real] == ids[real]).all())


def shifted_lm_loss(output, targets):
    """Cross-entropy of the logits at t against the label at t + 1 (transformers' causal
    LM loss), the mean over every shifted label that is not IGNORE_INDEX."""
    out = loss_input(output)
    out = out[..., :-1, :]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[..., 1:].reshape(-1).long(),
                           ignore_index=IGNORE_INDEX)


def shifted_token_items(x, y) -> int:
    return int((y[..., 1:] != IGNORE_INDEX).sum())
