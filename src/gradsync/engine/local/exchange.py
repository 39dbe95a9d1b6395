"""What a local-update sync sends: the summed pseudo-gradient, its items, the buffers.

DiLoCo's exchange (arXiv 2311.08105, Algorithm 1) averages
pseudo-gradients over workers; here they are summed together with the items each
worker processed since the last sync, so the outer step can weight each worker by
its data (``diloco.py``). The sum travels by the backend's all-reduce, a
compressor, or the two-level all-reduce when a worker is a host. Buffers
(BatchNorm statistics) are averaged with the same item weights. During a
synchronous warm-up (``diloco.py``) gradients travel instead, summed with items
as gradsync's exact data parallelism sums them (:func:`mean_gradients`).

Every figure of :class:`DiLoCoStats` is this rank's bytes on the wire, an exact
all-reduce counted as 2 (N-1)/N of its size (``compress.base.ring_bytes``).

The unit of a local-update sync: a set of parameters with its global (anchor) copy.

DiLoCo (arXiv 2311.08105) syncs the whole model as one fragment; Streaming DiLoCo
(arXiv 2501.18512, section 2.2) cuts it into F fragments synced at staggered
steps. A fragment computes this worker's item-weighted pseudo-gradient and,
given the sum over workers, steps the outer optimizer on its anchors and merges
the result into the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UsageError
from ..compress import Compressor, parse_compression
from ..compress.base import ring_bytes
from ..sync.item_window import as_count
from ..sync.replicas import broadcast_tensors
from ..transport import comm, host
from ..transport.algorithms import hierarchical
from ..transport.algorithms.topology import HostTopology


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


def as_items(num_items) -> float:
    """Items of one inner step: ``None`` counts one (every worker takes the same steps)."""
    return 1.0 if num_items is None else as_count(num_items)


def resolve_compressor(compress) -> Compressor | None:
    if compress is None or isinstance(compress, Compressor):
        return compress
    if isinstance(compress, str):
        return parse_compression(compress)
    raise UsageError(f"compress must be None, a string like 'int8' or a Compressor, "
                     f"got {type(compress).__name__}")


@dataclass(frozen=True)
class DiLoCoStats:
    """Communication of this rank so far.

    bytes_sent: what this rank put on the wire for pseudo-gradients, item counts and
        buffers (exact all-reduces counted as 2 (N-1)/N of their size).
    exact_bytes: the same for uncompressed pseudo-gradients.
    """

    steps: int
    syncs: int
    bytes_sent: int
    exact_bytes: int
    last_sync_bytes: int

    @property
    def bytes_per_sync(self) -> float:
        return self.bytes_sent / self.syncs if self.syncs else 0.0

    @property
    def ratio(self) -> float:
        return self.exact_bytes / self.bytes_sent if self.bytes_sent else math.nan


def sum_with_items(compressor: Compressor | None, key: int, shapes, flat: torch.Tensor,
                   items: float, group, step=None):
    """Sum ``flat`` and the item counts over ranks (blocking).

    Returns (flat, total items, bytes sent, bytes an exact all-reduce would send).
    ``group`` may be a :class:`HostTopology`: the two-level all-reduce over the world
    (what a rank sends is the same 2 (N-1)/N of the size as a flat ring's; half or
    more of it stays inside the host).

    Touches only its arguments: streaming DiLoCo runs it on a thread.
    """
    topology = group if isinstance(group, HostTopology) else None
    group = None if topology is not None else group
    count = torch.tensor([items], dtype=torch.float64, device=flat.device)
    world = dist.get_world_size(group)
    if topology is not None:
        hierarchical.all_reduce_(flat, topology, tag="diloco")
        sent = ring_bytes(flat.numel() * flat.element_size(), world)
        # the count too only on the topology's groups (integers: exact in any order):
        # streaming DiLoCo's thread owns its topology, and a count summed on the world
        # group from there raced the main thread's collectives on it (a hang)
        for on in (topology.intra_group, topology.inter_group):
            comm.all_reduce(count, on, tag="diloco-items")
    else:
        pending = comm.all_reduce(count, group, async_op=True, tag="diloco-items")
        if compressor is None:
            comm.all_reduce(flat, group, tag="diloco", meta={"fragment": key, "step": step})
            sent = ring_bytes(flat.numel() * flat.element_size(), world)
        else:
            before = compressor.stats().sent_bytes
            compressor.all_reduce_(key, flat, shapes, group)
            sent = compressor.stats().sent_bytes - before
        pending.wait()
    header = ring_bytes(count.numel() * count.element_size(), world)
    exact = ring_bytes(flat.numel() * flat.element_size(), world)
    return flat, float(host.read(count)[0]), sent + header, exact + header


def average_buffers(float_buffers: list[torch.Tensor], other_buffers: list[torch.Tensor],
                    items: float, group) -> int:
    """Item-weighted average of float buffers, rank 0's integer buffers; bytes sent."""
    if not (float_buffers or other_buffers):
        return 0
    world = dist.get_world_size(group)
    sent = 0
    if float_buffers:
        dtype = torch.float64
        device = float_buffers[0].device
        flat = torch.cat([b.detach().reshape(-1).to(dtype) * items for b in float_buffers]
                         + [torch.tensor([items], dtype=dtype, device=device)])
        comm.all_reduce(flat, group, tag="diloco-buffers")
        sent += ring_bytes(flat.numel() * flat.element_size(), world)
        total = float(host.read(flat[-1:])[0])
        if total > 0:
            offset = 0
            with torch.no_grad():
                for b in float_buffers:
                    k = b.numel()
                    b.copy_(flat[offset:offset + k].view_as(b) / total)
                    offset += k
    if other_buffers:
        broadcast_tensors(other_buffers, group, tag="diloco-buffers")
        sent += sum(b.numel() * b.element_size() for b in other_buffers)
    return sent


def mean_gradients(params: list[torch.Tensor], weight: float, items: float, group) -> int:
    """One synchronous step's gradient: ``p.grad <- sum over ranks (weight * p.grad) / sum
    of items``, identical on every rank; bytes sent.

    A worker whose ``p.grad`` holds the sum over its items passes weight 1 and its
    item count (gradsync's exact weighting: the mean over the global batch); one
    holding its own mean passes its items twice. A missing ``.grad`` counts as zeros
    (a worker without data) and every parameter leaves with a gradient.
    """
    if not params:
        return 0
    dtype = params[0].dtype
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                      .detach().reshape(-1).to(dtype) for p in params])
    if weight != 1:
        flat.mul_(weight)
    count = torch.tensor([items], dtype=torch.float64, device=flat.device)
    pending = comm.all_reduce(count, group, async_op=True, tag="diloco-warmup-items")
    comm.all_reduce(flat, group, tag="diloco-warmup")
    pending.wait()
    total = float(host.read(count)[0])
    if total > 0:
        flat.div_(total)
    offset = 0
    with torch.no_grad():
        for p in params:
            k = p.numel()
            part = flat[offset:offset + k].view_as(p)
            if p.grad is None:
                p.grad = part.to(p.dtype).clone()
            else:
                p.grad.copy_(part)
            offset += k
    world = dist.get_world_size(group)
    return ring_bytes(flat.numel() * flat.element_size() + 8, world)
