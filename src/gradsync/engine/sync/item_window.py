"""The item count of one accumulation window: what makes ``backward(loss, num_items=n)`` exact.

A synchronised step must divide the summed gradient by the number of items (samples
or tokens) in the whole global batch: every rank's micro-steps since the last
synchronised backward. Each rank counts its own window here; the counts travel
in a small header summed with the gradients, and :meth:`ItemWindow.close` turns the
global sums into the divisor. The same header detects a window that mixed
``backward(loss, num_items=n)`` with plain ``loss.backward()`` anywhere, which has
no exact meaning, and raises on every rank alike (all ranks see the same sums).

The synchronised-backward core (``core.py``) owns the one instance per model,
for DataParallel, ZeroOptimizer (through DataParallel) and FullyShardedDataParallel.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ...errors import UsageError
from ..transport import host

HEADER_SLOTS = 4  # items (high, low base-4096 digits), num_items passes, plain passes
_DIGIT = 4096
MAX_ITEMS = 2**36


class ItemWindow:
    """This rank's counts since the last synchronised backward."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank
        self.items, self.item_passes, self.plain_passes = 0, 0, 0
        self._counted = False  # the running pass is already counted
        self.closed_plain = False  # the last closed window held plain passes (on any rank)

    @contextlib.contextmanager
    def item_pass(self, n: int):
        """Around ``backward(loss, num_items=n)``: the pass counts ``n`` items."""
        self.items += n
        self.item_passes += 1
        self._counted = True
        try:
            yield
        finally:
            self._counted = False

    @contextlib.contextmanager
    def uncounted_pass(self):
        """Around a pass that counts neither items nor as a plain pass: a rank whose
        inputs ran out shadowing the others' backward (``join.py``)."""
        self._counted = True
        try:
            yield
        finally:
            self._counted = False

    def pass_joined(self) -> None:
        """A parameter joined a backward; outside :meth:`item_pass` it is a plain
        ``loss.backward()``. Counted at the first parameter, not when the pass began: a
        pass no parameter joins (``torch.autograd.grad`` for a gradient penalty) is not
        a plain pass and must not make the window look mixed."""
        if not self._counted:
            self.plain_passes += 1
            self._counted = True

    def reset(self) -> None:
        """Start a new window without closing this one (its step failed)."""
        self.items, self.item_passes, self.plain_passes = 0, 0, 0

    def pass_ended(self) -> None:
        """A plain pass is counted once however many hooks announced it."""
        self._counted = False

    def values(self) -> list[float]:
        """The counts as whole numbers that survive a float32 sum exactly.

        Items split into base-4096 digits: every digit summed over up to 4096 ranks
        stays below 2**24, float32's exact-integer range, and the high digit covers
        up to 2**36 items per window.
        """
        items = int(self.items)
        if items >= MAX_ITEMS // self.world_size:
            raise UsageError(f"{items} items in one accumulation window on rank {self.rank}; "
                             f"the exact count supports fewer than {MAX_ITEMS // self.world_size}")
        return [float(items // _DIGIT), float(items % _DIGIT),
                float(self.item_passes), float(self.plain_passes)]

    def write(self, slots: torch.Tensor) -> None:
        """:meth:`values` into ``slots`` (from host memory, without blocking the host:
        the header is written inside backward, from a gradient hook)."""
        copy_in(slots, self.values(), self)


    def close(self, summed: torch.Tensor, plain_divisor: float | None = None) -> float:
        """The divisor from the header summed over ranks; starts a new window.

        ``plain_divisor``: what plain ``loss.backward()`` windows divide by (default the
        world size, DDP's convention; ``join.py`` may say the active ranks).

        Raises on every rank alike for a window that mixed both kinds of backward or
        whose global batch holds no items.
        """
        hi, lo, item_passes, plain_passes = host.read(summed).tolist()
        items = hi * _DIGIT + lo
        mine = (self.item_passes, self.plain_passes)
        self.reset()
        self.closed_plain = bool(plain_passes)
        if item_passes and plain_passes:
            raise UsageError(
                f"this accumulation window mixed backward(loss, num_items=n) ({int(item_passes)} "
                f"passes over all ranks) with plain loss.backward() ({int(plain_passes)} passes); "
                f"use one or the other on every rank and micro-step (rank {self.rank} had "
                f"{mine[0]} and {mine[1]})")
        if item_passes:
            if items <= 0:
                raise UsageError("the global batch holds no items (num_items summed to 0 over all "
                                 "ranks and micro-steps); the mean loss is undefined")
            return items
        return float(self.world_size if plain_divisor is None else plain_divisor)


def as_count(num_items) -> float:
    """``num_items`` as a whole number >= 0 (a Python number or a one-element tensor)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise UsageError(
                f"num_items must be a scalar, got a tensor of shape {tuple(num_items.shape)}")
        num_items = host.read(num_items).item()
    try:
        n = float(num_items)
    except (TypeError, ValueError):
        raise UsageError(f"num_items must be a number, got {num_items!r}") from None
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise UsageError(f"num_items counts items: a whole number >= 0, got {num_items!r}")
    return n


def copy_in(slots: torch.Tensor, values: list[float], owner) -> None:
    """``values`` into the device tensor ``slots`` through the owner's host staging
    buffer (pinned on a GPU: an asynchronous copy). Reusing the buffer is safe: the
    previous header was read on the host (its window's close) before this one."""
    staging = getattr(owner, "_staging", None)
    if staging is None or staging.dtype != slots.dtype or staging.numel() < len(values):
        staging = owner._staging = host.staging(max(len(values), 16), slots.dtype,
                                                slots.device)
    staging[:len(values)] = torch.tensor(values, dtype=slots.dtype)
    slots.copy_(staging[:len(values)], non_blocking=True)
