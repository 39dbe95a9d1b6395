"""``--activation-checkpointing``: each block's activations recomputed in backward, not kept.

A transformer keeps, per layer, tensors of ``34sbh + 5as^2b`` bytes for its backward
(``plan/memory.py``); checkpointing a block keeps only its input and runs its forward again
when backward reaches it: memory of one layer's activations instead of L, for about one
more forward (a third more compute). What is checkpointed, per model:

* the built-in ``gpt``: its blocks (``GPTConfig.checkpoint_activations``);
* a transformers ``PreTrainedModel`` that supports it: its own
  ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before transformers
  renamed it; it also turns off the key/value cache training must not keep),
  non-reentrant -- what a transformers user gets from ``Trainer``;
* any other model: its blocks, found as ZeRO-3 finds the units it shards
  (``engine/strategy/exact.default_wrap``: the class of the largest ``ModuleList`` or
  ``Sequential`` of two or more modules of one class -- a transformer's layers). Each
  block's ``forward`` is wrapped, on the instance, in ``torch.utils.checkpoint``
  (non-reentrant), so the module tree and every parameter name stay as they are:
  checkpoints, parameter groups, ``--init-from`` and exports see the same model. A model
  without such a container is refused in one line (there is nothing to checkpoint
  per block; give the model one, or leave out the flag).

The same numbers: the recomputed forward is the same operations on the same inputs, and
the RNG state is restored for it (``preserve_rng_state``: dropout draws the same masks), so
a run with the flag takes the same steps as without -- tested in float64, bit for bit,
under ddp and zero3 (``tests/train/test_memory_flags.py``). The gradients of a block's
parameters become ready during its recomputation, which the synchronised backward expects
(``engine/sync/arrivals.py``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...engine.strategy.exact import default_wrap
from ...errors import UsageError

MARK = "_gradsync_recompute"


def _is_transformers(model: nn.Module) -> bool:
    if not any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _wrap(block: nn.Module) -> None:
    if getattr(block, MARK, False):
        return
    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation keeps nothing anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed
    setattr(block, MARK, True)


def checkpoint_blocks(model: nn.Module, name: str) -> str:
    """Turn on activation checkpointing in ``model`` (not the built-in gpt, which takes it
    as a config); what was checkpointed, in words."""
    if _is_transformers(model) and getattr(model, "supports_gradient_checkpointing", False):
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return f"{type(model).__name__}'s own gradient checkpointing"
    kinds = default_wrap(model)
    if not kinds:
        raise UsageError(f"--activation-checkpointing checkpoints a model block by block, and "
                         f"--model {name} has no blocks (a ModuleList or Sequential of two or more "
                         "modules of one class, as a transformer's layers): give it one, or "
                         "leave out the flag")
    blocks = [m for m in model.modules() if type(m) in kinds]
    for block in blocks:
        _wrap(block)
    kind = next(iter(kinds)).__name__
    return f"{len(blocks)} {kind} block{'s' * (len(blocks) != 1)}"
