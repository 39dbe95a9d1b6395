"""One accumulation window: its item count, what makes ``num_items=n`` exact, and its fingerprint.

A synchronised step must divide the summed gradient by the number of items (samples
or tokens) in the whole global batch: every rank's micro-steps since the last
synchronised backward. Each rank counts its own window here; the counts travel
in a small header summed with the gradients, and :meth:`ItemWindow.close` turns the
global sums into the divisor. The same header detects a window that mixed
``backward(loss, num_items=n)`` with plain ``loss.backward()`` anywhere, which has
no exact meaning, and raises on every rank alike (all ranks see the same sums).

The synchronised-backward core (``core.py``) owns the one instance per model,
for DataParallel, ZeroOptimizer (through DataParallel) and FullyShardedDataParallel.

The accumulation window's fingerprint: desync named where it happens, at no extra round
trip. The item-count header (above) is all-reduced at every synchronised
backward anyway: in the first bucket when buckets are summed exactly, else as a
32-byte all-reduce of its own. :class:`CheckedWindow` appends
``fingerprint.SLOTS`` (9) whole numbers to it: an "on" flag and four digits (and
their squares) of a digest of

* the collectives this rank issued on the header's group since the previous
  check: count and a running hash of (op, dtype, element count)
  (``transport/fingerprint.py``);
* the optimizer steps taken since the previous synchronised backward by an
  optimizer of this model, and how many of them were taken with micro-steps
  accumulated after that backward and never synchronised (``no_sync`` after the
  sync: that rank steps on its own gradients).

Summed over the ranks, a digit and its square tell whether every rank wrote the
same digit (``world * sum(d**2) == sum(d)**2`` exactly when all are equal), and
every rank sees the same sums, so every rank decides alike; only then are the
ranks' logs gathered to name the ranks, the step and the first differing
collective (:class:`~gradsync.engine.transport.fingerprint.DesyncError`).

The number of micro-steps is reported but not compared: ranks may hold
different numbers of micro-batches in one window (``backward(loss, num_items)``
makes that exact). Under ``join()`` optimizer steps are left out: neither
counted while the context is open (a rank that left steps only with
``optimizer=``) nor compared in a window that had a pass inside it.
``GRADSYNC_DESYNC_CHECK=0`` turns the check off (it is on when any rank has it
on, so ranks cannot disagree about it).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...errors import UsageError
from ..transport import comm, fingerprint, host
from ..transport.fingerprint import DesyncError
from .desync_text import explain

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


WINDOW_SLOTS = HEADER_SLOTS + fingerprint.SLOTS
_windows: weakref.WeakSet = weakref.WeakSet()
_hook = None


def enabled_by_default() -> bool:
    return os.environ.get("GRADSYNC_DESYNC_CHECK", "1").strip().lower() not in ("0", "false", "off")


def _on_step(optimizer, args, kwargs) -> None:
    for w in list(_windows):
        w.optimizer_step(optimizer)


class CheckedWindow(ItemWindow):
    """The item window of one model, plus what its fingerprint needs (module docstring)."""

    def __init__(self, world_size: int, rank: int, owner):
        super().__init__(world_size, rank)
        global _hook
        self.enabled = enabled_by_default()
        self._owner = weakref.ref(owner)
        self.syncs = 0  # synchronised backwards completed: the next one is step syncs + 1
        self.passes = 0  # micro-steps (passes a parameter joined) in the open window
        self.steps = self.dirty = 0  # optimizer steps since the last sync; with passes pending
        self.under_join = False
        self._owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._sent: dict | None = None
        self._worlds: dict = {}
        _windows.add(self)
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_on_step)

    # ------------------------------------------------------------ what is counted
    def pass_joined(self) -> None:
        super().pass_joined()
        self.passes += 1
        self._join_open()

    def _join_open(self) -> None:
        owner = self._owner()
        if owner is not None and owner._join_state is not None:
            self.under_join = True

    def optimizer_step(self, optimizer) -> None:
        owns = self._owns.get(optimizer)
        if owns is None:
            owns = self._owns[optimizer] = self._is_mine(optimizer)
        owner = self._owner()
        if owns and owner is not None and owner._join_state is None:  # join: see docstring
            self.steps += 1
            self.dirty += self.passes > 0

    def _is_mine(self, optimizer) -> bool:
        owner = self._owner()
        if owner is None:
            return False
        if any(v is owner for v in vars(optimizer).values()):  # ZeroOptimizer(model, ...)
            return True
        mine = {id(p) for p in owner.parameters()}
        try:
            mine |= {id(t) for _, t in owner._optimizer_pieces()}
        except (NotImplementedError, AttributeError):
            pass
        return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])

    # ------------------------------------------------------------ header
    def write(self, slots: torch.Tensor, group=None) -> None:
        """Items into the first HEADER_SLOTS, the fingerprint after them; the log of
        ``group`` (the header's) is cut here, on every rank at the same point."""
        values = self.values()
        if slots.numel() < WINDOW_SLOTS:
            self._sent = None
            copy_in(slots[:HEADER_SLOTS], values, self)
            return
        log = fingerprint.log_for(group)
        stepping = () if self.under_join else (self.steps, self.dirty)
        value = fingerprint.mix(log.count, log.digest, *stepping)
        self._sent = {"group": group, "log": log.name, "count": log.count,
                      "check": log.seq + 1, "records": [
                          (r.seq, r.op, r.dtype, r.numel, r.tag) for r in log.recent],
                      "passes": self.passes, "steps": self.steps, "dirty": self.dirty,
                      "join": self.under_join}
        log.checked()
        world = self._world(group)
        values += fingerprint.encode_values(value, world, self.enabled)
        copy_in(slots[:WINDOW_SLOTS], values, self)  # one copy for the whole header

    def _world(self, group) -> int:
        if group not in self._worlds:
            self._worlds[group] = dist.get_world_size(group)
        return self._worlds[group]

    def reset(self) -> None:
        super().reset()
        self.passes = self.steps = self.dirty = 0
        self.under_join = False

    def close(self, summed: torch.Tensor, plain_divisor: float | None = None) -> float:
        sent, self._sent = self._sent, None
        if sent is not None and summed.numel() >= WINDOW_SLOTS:
            slots = host.read(summed[HEADER_SLOTS:WINDOW_SLOTS]).tolist()
            world = self._world(sent["group"])
            if slots[0] > 0 and not fingerprint.agree(slots, world):
                step = self.syncs + 1
                self.syncs += 1
                self.reset()
                raise DesyncError(self._explain(sent, step, summed, world))
        self.syncs += 1
        divisor = super().close(summed[:HEADER_SLOTS], plain_divisor)
        self.passes = self.steps = self.dirty = 0
        self.under_join = False
        return divisor

    def _explain(self, sent: dict, step: int, like: torch.Tensor, world: int) -> str:
        """Gather every rank's account of this window (the ranks agree that they
        disagree, so all of them are here) and name the difference."""
        mine = dict(sent, rank=self.rank, step=step)
        mine.pop("group")
        infos = gather_objects(mine, sent["group"], like.device, world)
        return explain(infos)


def gather_objects(obj, group, device, world: int) -> list:
    """Every rank's picklable ``obj`` (through ``comm``: two collectives; error path only)."""
    data = pickle.dumps(obj)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.all_reduce(n, group, op=dist.ReduceOp.MAX, tag="desync")
    size = int(host.read(n).item())
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    out = torch.empty(size * world, dtype=torch.uint8, device=device)
    comm.all_gather_single(out, buf, group, tag="desync")
    raw = host.read(out).numpy().tobytes()
    return [pickle.loads(raw[i * size:(i + 1) * size]) for i in range(world)]
