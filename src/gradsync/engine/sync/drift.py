"""Drift check: are the replicas still bit-identical?

Data parallelism rests on one invariant: every rank applies the same update to
the same parameters, so replicas never diverge (DDP paper, arXiv 2006.15704,
section 3: "all model replicas start from the same state and receive the same
gradients"). The engine establishes it at construction (broadcast); this checks
it is still true mid-run. A non-deterministic kernel, a rank-local change to a
parameter, or an optimizer fed a rank-local quantity all break it silently --
training goes on, the checkpoint holds rank 0's copy, and nobody knows.

Cost: per parameter three 64-bit numbers -- the float64 sum (for people) and
two exact integer checksums of the raw bits (plain and position-weighted, so
that swapped or sign-flipped elements are caught) -- gathered in one small
collective. A mismatch raises the same error on every rank, naming the first
differing parameter and the ranks that disagree with rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...dist import comm_device
from ...errors import ReplicaMismatchError
from ..transport import comm, host

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHT_PERIOD = 65521  # prime: position weights 1..65521


def parameter_checksums(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and an int64 tensor [P, 3]: float64 sum (bits), bit sum, weighted bit sum."""
    names, rows = [], []
    with torch.no_grad():
        for name, p in module.named_parameters():
            flat = p.detach().reshape(-1)
            bits = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
            weights = torch.arange(bits.numel(), device=bits.device) % _WEIGHT_PERIOD + 1
            fsum = flat.to(torch.float64).sum().view(1).view(torch.int64)
            rows.append(torch.stack([fsum[0], bits.sum(), (bits * weights).sum()]))
            names.append(name)
    if not rows:
        return names, torch.zeros(0, 3, dtype=torch.int64)
    return names, host.read(torch.stack(rows))


def check_replicas(module: nn.Module, group=None, step: int | None = None) -> int:
    """Raise :class:`ReplicaMismatchError` on every rank if any parameter differs.

    Returns the number of parameters compared. Every rank of ``group`` must call
    it at the same point (it is a collective).
    """
    names, sums = parameter_checksums(module)
    world = dist.get_world_size(group)
    dev = comm_device(group)
    mine = sums.reshape(-1).to(dev)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=dev)
    comm.all_gather_single(everyone, mine, group=group, tag="drift")
    table = host.read(everyone.view(world, len(names), 3))
    same = (table == table[0]).all(dim=2)  # [world, P]
    if bool(same.all()):
        return len(names)
    bad = (~same).any(dim=0).nonzero().flatten().tolist()
    i = bad[0]
    ranks = [r for r in range(world) if not bool(same[r, i])]
    fsums = [float(table[r, i, 0:1].view(torch.float64)) for r in range(world)]
    when = f" at step {step}" if step is not None else ""
    detail = ", ".join(f"rank {r}: {fsums[r]:.17g}" for r in [0, *ranks])
    raise ReplicaMismatchError(
        f"replicas drifted{when}: parameter {names[i]!r} differs between rank 0 and "
        f"rank(s) {', '.join(map(str, ranks))} (float64 sums {detail}); "
        f"{len(bad)} of {len(names)} parameters differ. Every rank must apply the same "
        "update: look for rank-local changes to parameters or non-deterministic kernels"
    )
