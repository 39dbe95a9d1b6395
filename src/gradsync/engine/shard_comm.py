"""How a sharded strategy moves a flat buffer: chosen per backend from measurements.

ZeRO (arXiv 1910.02054, section 7) counts volume: a reduce-scatter and an
all-gather each move about Psi, half of an all-reduce's 2 Psi. Wall-clock cost is a
different matter. Measured on this project's machine (2 CPU cores, gloo over
loopback, torch 2.13, 2 ranks, best of 2 alternating medians of 5;
``benchmarks/collectives.py 1 8 34``):

    MB   all_reduce ms   reduce_scatter ms   all_gather ms
     1        1.3               2.9               0.8
     8        7.2               9.6               6.2
    34       27.2              57.1              42.8

So on gloo a reduce-scatter costs more than an all-reduce of the same tensor at
every size, and an all-gather wins only up to a few MB. gloo therefore reduces a
bucket with an all-reduce and keeps this rank's slice, and gathers with
``all_gather_single`` up to ``GLOO_GATHER_MAX_BYTES`` and with an all-reduce of a
zero-filled buffer holding this rank's shard above that (x + 0 is exact; every
rank receives the same bits). NCCL implements the textbook ring collectives, so it
uses ``reduce_scatter_single`` and ``all_gather_single`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm

GLOO_GATHER_MAX_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ShardComm:
    """Which collective implements a shard reduction and a shard gather.

    reduce_op: ``"reduce_scatter"`` or ``"all_reduce"`` (then slice).
    gather_max_bytes: buffers up to this size use ``all_gather_single``; larger ones
        an all-reduce of a zero-filled buffer (``None``: always all-gather).
    """

    reduce_op: str = "reduce_scatter"
    gather_max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.reduce_op not in ("reduce_scatter", "all_reduce"):
            raise ValueError("reduce_op must be 'reduce_scatter' or 'all_reduce', "
                             f"got {self.reduce_op!r}")

    @staticmethod
    def for_group(group=None, choice: str = "auto") -> ShardComm:
        """``choice``: ``"auto"`` (per backend, as measured), ``"native"`` or ``"all_reduce"``."""
        if choice == "native":
            return ShardComm("reduce_scatter", None)
        if choice == "all_reduce":
            return ShardComm("all_reduce", 0)
        if choice != "auto":
            raise ValueError(
                f"collectives must be 'auto', 'native' or 'all_reduce', got {choice!r}")
        if dist.get_backend(group) == "gloo":
            return ShardComm("all_reduce", GLOO_GATHER_MAX_BYTES)
        return ShardComm("reduce_scatter", None)

    def reduce(self, full: torch.Tensor, rank: int, world: int, group, tag: str
               ) -> tuple[comm.Pending, torch.Tensor]:
        """Launch the sum of ``full`` over ranks; returns (pending, this rank's slice).

        The slice is valid once ``pending.wait()`` returned. ``full`` may be
        overwritten (the all-reduce path works in place).
        """
        n = full.numel() // world
        if self.reduce_op == "all_reduce":
            pending = comm.all_reduce(full, group, async_op=True, tag=tag)
            return pending, full[rank * n:(rank + 1) * n]
        out = torch.empty(n, dtype=full.dtype, device=full.device)
        pending = comm.reduce_scatter_single(out, full, group, async_op=True, tag=tag)
        return pending, out

    def gather(self, full: torch.Tensor, shard: torch.Tensor, rank: int, group, tag: str
               ) -> comm.Pending:
        """Launch filling ``full`` with every rank's ``shard`` (rank-major).

        ``shard`` must not alias ``full``.
        """
        nbytes = full.numel() * full.element_size()
        if self.gather_max_bytes is not None and nbytes > self.gather_max_bytes:
            n = shard.numel()
            full.zero_()
            full[rank * n:(rank + 1) * n].copy_(shard)
            return comm.all_reduce(full, group, async_op=True, tag=tag)
        return comm.all_gather_single(full, shard, group, async_op=True, tag=tag)
