"""Hooks that run before autograd accumulates a parameter's gradient.

A synchronised backward must know it has started before the first gradient lands
in ``.grad``: gradients held from before the window are set aside at that moment,
and a post-accumulate hook that starts the pass is too late (that parameter's
``.grad`` already holds this pass's gradient, which would be set aside as if held
from before). A parameter used only in the loss, outside forward, can be reached
before any output hook runs, so the output hooks cannot be relied on either. A
pre-hook on each parameter's gradient accumulator (the ``AccumulateGrad`` node)
runs first. The nodes are held here, as torch DDP holds them: a tensor keeps only a
weak reference to its accumulator, and a new node would not carry the hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def hook_accumulators(params, before: Callable[[int, bool], None]) -> tuple[list, list]:
    """Register ``before(i, defined)`` on the gradient accumulator of every trainable
    parameter ``i``: ``defined`` says whether a gradient is about to be accumulated
    (False for an undefined one), which ``.grad`` cannot say once it is a bucket view
    autograd writes into.

    Returns (the accumulator nodes, to keep alive; the removable handles).
    """
    nodes, handles = [], []
    with torch.enable_grad():  # a wrapper built under no_grad still needs the nodes
        for i, p in enumerate(params):
            if p.requires_grad:
                node = p.view_as(p).grad_fn.next_functions[0][0]
                nodes.append(node)
                handles.append(node.register_prehook(
                    lambda grads, i=i: before(i, grads[0] is not None)))
    return nodes, handles
