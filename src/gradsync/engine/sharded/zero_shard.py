"""One bucket as ZeRO shards it: the flat parameter buffer and this rank's slices.

ZeRO stages 1 and 2 (arXiv 1910.02054, sections 5.1-5.2) cut every DataParallel
bucket into N equal pieces (``shards.FlatShard``); rank r keeps the master weights
of piece r (a separate fp32 copy for bf16/fp16 parameters, else the piece of the
flat buffer itself) and its slice of the synchronised gradient. Also here: the
check that the inner optimizer is elementwise, the condition for stepping pieces
of tensors.
"""

from __future__ import annotations

import torch

from ...errors import UsageError
from ..replicated.precision import master_dtype
from .shard_view import ShardView
from .shards import FlatShard

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta)


def check_elementwise(optimizer_class) -> None:
    """Reject optimizers whose update needs whole tensors (LBFGS, factored or matrix methods)."""
    if optimizer_class in ELEMENTWISE or getattr(optimizer_class, "gradsync_elementwise", False):
        return
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise UsageError(
        f"{name} cannot run on shards: a sharded optimizer holds pieces of tensors, so its "
        f"update must be elementwise. Allowed: {allowed}; a custom elementwise optimizer "
        "may declare `gradsync_elementwise = True`")


class BucketShard:
    """One bucket's flat parameter buffer, this rank's master slice and gradient slice."""

    def __init__(self, bucket, world: int, rank: int, originals: dict[int, torch.Tensor]):
        self.bucket = bucket
        self.layout = FlatShard(tuple(p.numel() for p in bucket.params), world)
        self.start, self.end = self.layout.shard_range(rank)
        p0 = bucket.params[0]
        self.flat = torch.zeros(self.layout.padded, dtype=p0.dtype, device=p0.device)
        full = torch.zeros(self.layout.padded, dtype=master_dtype(p0.dtype), device=p0.device)
        offset = 0
        with torch.no_grad():
            for p in bucket.params:
                n = p.numel()
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset:offset + n].view_as(p)
                # the master starts from the full-precision values, not their rounded copy
                full[offset:offset + n].copy_(originals[id(p)].reshape(-1))
                offset += n
        if master_dtype(p0.dtype) == p0.dtype:
            # fp32/fp64 parameters: the master *is* this rank's slice of the flat
            # parameter buffer (no second copy; torch's ZeroRedundancyOptimizer also
            # steps the parameters in place); the gather re-fills the other slices
            self.master = self.flat[self.start:self.end]
        else:
            self.master = full[self.start:self.end].clone()
        self.view = ShardView(self.master, self.layout, rank)
        self.grad: torch.Tensor | None = None  # this rank's slice of the synced gradient
        self.separate_master = master_dtype(p0.dtype) != p0.dtype
        self.has_grad = [False] * len(bucket.params)  # per parameter of the bucket
        self.aside: tuple[torch.Tensor, list[bool]] | None = None  # from before the window
        self.reduced: torch.Tensor | None = None  # during a sync: the reduced slice
        self.src: torch.Tensor | None = None  # during a sync: the buffer being reduced
        self.pending = None  # during a sync: the reduction in flight
        self.partial: torch.Tensor | None = None  # stage 2: reduced slice, not yet divided

    def load_master(self, values: dict[int, torch.Tensor]) -> None:
        """This rank's master slice from full-precision values (``id(param)`` -> tensor)
        of the bucket's parameters; a parameter without a value keeps its master."""
        offset = 0
        with torch.no_grad():
            for p in self.bucket.params:
                n = p.numel()
                lo, hi = max(offset, self.start), min(offset + n, self.end)
                v = values.get(id(p))
                if v is not None and lo < hi:
                    flat = v.detach().reshape(-1).to(self.master.dtype)
                    mine = self.master[lo - self.start:hi - self.start]
                    mine.copy_(flat[lo - offset:hi - offset])
                offset += n
