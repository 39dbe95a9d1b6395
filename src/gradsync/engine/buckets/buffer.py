"""Flat gradient buffers whose slices are the parameters' ``.grad``.

Each bucket owns one contiguous buffer; every parameter in it gets
``param.grad = buffer[offset:offset + numel].view_as(param)``. Autograd then
accumulates straight into the buffer, so launching the bucket's collective needs
no copy (DDP's ``gradient_as_bucket_view``, arXiv 2006.15704 section 3.2.3).
"""

from __future__ import annotations

import torch

from .plan import BucketSpec


class Bucket:
    """One bucket's buffer, the views into it and its per-iteration ready count."""

    __slots__ = ("spec", "params", "buffer", "views", "pending", "handle", "launched", "zeroed")

    def __init__(self, spec: BucketSpec, params: list[torch.nn.Parameter],
                 numel: int | None = None):
        """``numel`` > ``spec.numel`` pads the buffer (ZeRO cuts it into equal shards)."""
        self.spec = spec
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(max(spec.numel, numel or 0), dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            n = p.numel()
            self.views.append(self.buffer[offset : offset + n].view_as(p))
            offset += n
        self.pending = len(params)
        self.handle = None
        self.launched = False
        self.zeroed = True  # no gradient has been written since the buffer was zeroed

    def attach(self, keep_values: bool = True) -> None:
        """Make every existing ``param.grad`` a view into this bucket.

        Existing gradients are copied in (``keep_values``) so a rebuild or a
        user who assigned ``.grad`` loses nothing; a ``None`` gradient stays None
        (as torch's ``zero_grad(set_to_none=False)`` leaves it) over zeros in the
        buffer, and the hook adopts the first gradient autograd hands over.
        """
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads) or not keep_values:  # after zero_grad(set_to_none)
            self.buffer.zero_()  # one fill instead of one per parameter
            if keep_values:
                return
            for p, view in zip(self.params, self.views):
                p.grad = view
            return
        for p, view, g in zip(self.params, self.views, grads):
            if g is view:
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
                p.grad = view
                self.zeroed = False

    def is_view(self, slot: int) -> bool:
        # Identity, not storage comparison: autograd accumulates in place, so the
        # tensor we assigned stays the very object; this check runs once per
        # parameter per backward, on the hot path.
        return self.params[slot].grad is self.views[slot]

    def adopt(self, slot: int) -> None:
        """Pull in a gradient autograd wrote elsewhere (e.g. after ``zero_grad(set_to_none)``)."""
        p, view = self.params[slot], self.views[slot]
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad)
            self.zeroed = False
        p.grad = view

    def reset(self) -> None:
        self.pending = len(self.params)
        self.handle = None
        self.launched = False

    def detach_grads(self) -> None:
        """Give every parameter a standalone copy of its gradient (used when unwrapping)."""
        for p, view in zip(self.params, self.views):
            if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                p.grad = view.clone()
