"""The unit of a local-update sync: a set of parameters with its global (anchor) copy.

DiLoCo (arXiv 2311.08105) syncs the whole model as one fragment; Streaming DiLoCo
(arXiv 2501.18512, section 2.2) cuts it into F fragments synced at staggered
steps. A fragment computes this worker's item-weighted pseudo-gradient and,
given the sum over workers, steps the outer optimizer on its anchors and merges
the result into the model.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import UsageError


def default_outer_optimizer(params) -> torch.optim.Optimizer:
    """The DiLoCo paper's outer optimizer (arXiv 2311.08105, section 3)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def local_sgd_outer_optimizer(params) -> torch.optim.Optimizer:
    """Outer SGD lr 1, no momentum: the global copy becomes the (item-weighted) average."""
    return torch.optim.SGD(params, lr=1.0)


class Fragment:
    """A set of parameters synchronised together, with its global (anchor) copy.

    Anchors are kept in float32 or wider even for low-precision parameters: the
    outer update is small against the weights.
    """

    def __init__(self, index: int, named: list[tuple[str, nn.Parameter]]):
        self.index = index
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.dtype = torch.float32
        for p in self.params:
            self.dtype = torch.promote_types(self.dtype, p.dtype)
        self.anchors = [nn.Parameter(p.detach().to(self.dtype).clone()) for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.items = 0.0  # items this worker processed since this fragment was last sent
        self.last_sent = 0  # the step it was last sent at
        self.outer_steps = 0  # outer steps taken on it (the momentum ramp counts them)

    def pack(self) -> torch.Tensor:
        """items x (anchor - parameter), flat: this worker's weighted pseudo-gradient."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.params[0].device)
        if self.items == 0:
            return flat.zero_()
        offset = 0
        with torch.no_grad():
            for a, p in zip(self.anchors, self.params):
                k = p.numel()
                local = p.detach().reshape(-1).to(self.dtype)
                torch.sub(a.view(-1), local, out=flat[offset:offset + k])
                offset += k
        return flat.mul_(self.items)

    def apply(self, flat: torch.Tensor, total: float, outer: torch.optim.Optimizer,
              alpha: float, merge: bool = True) -> None:
        """Outer step with the summed pseudo-gradient / total items, then (``merge``) merge
        into the model."""
        with torch.no_grad():
            if total > 0:
                offset = 0
                for a in self.anchors:
                    k = a.numel()
                    a.grad = flat[offset:offset + k].view_as(a).div(total)
                    offset += k
                outer.step()
                self.outer_steps += 1
                for a in self.anchors:
                    a.grad = None
            for p, a in zip(self.params if merge else (), self.anchors):
                if alpha == 0:
                    p.copy_(a)
                else:
                    p.mul_(alpha).add_(a.to(p.dtype), alpha=1 - alpha)


def split_parameters(model: nn.Module, fragments) -> list[list[tuple[str, nn.Parameter]]]:
    """Trainable parameters in F contiguous runs of about equal size, or as named.

    A parameter joins the next run when its middle lies past the run's share.

    ``fragments``: an int F, or a list of lists of parameter names (every trainable
    parameter exactly once).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise UsageError("the model has no trainable parameters to synchronise")
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if not 1 <= fragments <= len(named):
            raise UsageError(f"fragments must be between 1 and the number of trainable "
                             f"parameters ({len(named)}), got {fragments}")
        total = sum(p.numel() for _, p in named)
        out: list[list] = [[]]
        cum = 0
        for i, (n, p) in enumerate(named):
            need, left = fragments - len(out), len(named) - i
            past_middle = cum + p.numel() / 2 >= len(out) * total / fragments
            if out[-1] and need and (need >= left or past_middle):
                out.append([])
            out[-1].append((n, p))
            cum += p.numel()
        return out
    by_name = dict(named)
    listed = [n for group in fragments for n in group]
    unknown = [n for n in listed if n not in by_name]
    missing = [n for n in by_name if n not in listed]
    if unknown or missing or len(listed) != len(set(listed)) or not all(fragments):
        raise UsageError("fragments must name every trainable parameter exactly once, in "
                         f"non-empty groups (unknown {unknown[:3]}, missing {missing[:3]})")
    return [[(n, by_name[n]) for n in group] for group in fragments]


def build_outer_optimizer(outer, fragments: list[Fragment], default) -> torch.optim.Optimizer:
    """The outer optimizer over the fragments' anchors (the global copy).

    ``outer``: None (``default(anchors)``), a factory ``f(params) -> Optimizer``, or an
    optimizer already built over the model's own parameters (as torchft's DiLoCo takes
    it): rebuilt with the same class and per-group options, each parameter replaced by
    its anchor. Its state, if any, is not carried over (a new run's outer state).
    """
    anchors = [a for f in fragments for a in f.anchors]
    if not isinstance(outer, torch.optim.Optimizer):
        built = (outer or default)(anchors)
        if not isinstance(built, torch.optim.Optimizer):
            raise UsageError("outer_optimizer(params) must return a torch.optim.Optimizer, "
                             f"got {type(built).__name__}")
        return built
    anchor_of = {id(p): a for f in fragments for p, a in zip(f.params, f.anchors)}
    name_of = {id(p): n for f in fragments for p, n in zip(f.params, f.names)}
    groups, seen = [], set()
    for g in outer.param_groups:
        if any(id(p) not in anchor_of for p in g["params"]):
            raise UsageError("outer_optimizer holds a tensor that is not a trainable "
                             "parameter of the model")
        seen |= {id(p) for p in g["params"]}
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [anchor_of[id(p)] for p in g["params"]]})
    left_out = [name_of[i] for i in anchor_of if i not in seen]
    if left_out:
        raise UsageError(f"outer_optimizer must hold every trainable parameter (each sync "
                         f"resets a parameter to its global copy); missing: {left_out[:5]}")
    return type(outer)(groups, **outer.defaults)
