"""A running fingerprint of every collective, per process group.

Replicas drift silently when ranks disagree about *which* collectives they issue:
a micro-step under ``no_sync`` on one rank only, two synchronised backwards per
step on one rank and one on another, a collective only some ranks call. torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` catches that by checking every collective with
one of its own (a round trip each); this module keeps the check cheap instead:

* every collective through ``comm.py`` folds ``(op, dtype, element count)`` into
  a 64-bit running digest of its group's log and gets a sequence number
  (a few hundred nanoseconds, no communication);
* the synchronised-backward core folds that digest, with what happened to the
  accumulation window (optimizer steps since the last sync, and steps taken
  with unsynchronised micro-steps pending), into a few whole-number slots that
  ride in the item-count header it all-reduces anyway (``sync/item_window.py``);
* only when the summed slots say the ranks differ are the logs gathered, to name
  the ranks, the step and the first differing collective.

Logs are kept per group, whichever thread issues: NCCL needs one issuing order per
group on every rank, and that order is what is checked. A communication thread runs
a private group of its own concurrently with the main thread (the order between the
two is a race, the order inside each is the program's). The thread that issues on a
group may change: on a GPU autograd runs backward, and the gradient hooks that
launch the buckets' collectives, on its device thread, while a rank without data
replays them, and ``join()`` shadows them, on the main thread. Logs kept per
(group, thread) saw different counts there: a false DesyncError.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ...errors import ReplicaMismatchError

MASK = (1 << 64) - 1
KEEP = 256  # records kept since the last check, for naming the first difference


class DesyncError(ReplicaMismatchError):
    """Ranks issued different collectives or stepped differently; raised on every rank."""


class Record:
    """One collective: what the fingerprint folds and the flight recorder keeps."""

    __slots__ = ("log", "seq", "op", "tag", "dtype", "numel", "nbytes", "start", "end",
                 "state", "work")

    def __init__(self, log, seq, op, tag, dtype, numel, nbytes, start):
        self.log, self.seq, self.op, self.tag = log, seq, op, tag
        self.dtype, self.numel, self.nbytes, self.start = dtype, numel, nbytes, start
        self.end: float | None = None
        self.state = "issued"
        self.work = None  # NCCL: the backend's work, until the device has completed it

    def key(self) -> tuple:
        """What must be equal on every rank for the same sequence number."""
        return (self.op, self.dtype, self.numel)

    def describe(self) -> str:
        tag = f" '{self.tag}'" if self.tag else ""
        return f"{self.op} #{self.seq}{tag} ({self.dtype} x {self.numel}, group {self.log.name})"

    def as_dict(self) -> dict:
        return {"group": self.log.name, "ranks": self.log.ranks, "seq": self.seq,
                "op": self.op, "tag": self.tag, "dtype": self.dtype, "numel": self.numel,
                "bytes": self.nbytes, "start": self.start, "end": self.end,
                "state": self.state}


class GroupLog:
    """The collectives issued on one process group."""

    __slots__ = ("name", "ranks", "seq", "digest", "count", "recent")

    def __init__(self, group):
        if group is None or group is dist.group.WORLD:
            self.name, self.ranks = "world", list(range(dist.get_world_size()))
        else:
            self.ranks = list(dist.get_process_group_ranks(group))
            self.name = "ranks " + ",".join(map(str, self.ranks))
        self.seq = 0  # collectives issued so far (the next one gets seq + 1)
        self.digest = 0  # over the collectives since the last check
        self.count = 0  # collectives since the last check
        self.recent: list[Record] = []  # the last KEEP of them

    def fold(self, rec: Record) -> None:
        self.digest = (self.digest * 1_000_003 + _code(rec.op, rec.dtype) * 1_000_033
                       + rec.numel) & MASK
        self.count += 1
        recent = self.recent
        recent.append(rec)
        if len(recent) > KEEP:
            del recent[: len(recent) - KEEP]

    def checked(self) -> None:
        """The ranks agreed up to here: start the next window's fingerprint."""
        self.digest, self.count, self.recent = 0, 0, []


_logs: dict[object, GroupLog] = {}
_codes: dict[tuple, int] = {}


def _code(op: str, dtype: str) -> int:
    code = _codes.get((op, dtype))
    if code is None:  # crc32, not hash(): str hashes differ between processes
        code = _codes[op, dtype] = zlib.crc32(f"{op}/{dtype}".encode())
    return code


def log_for(group) -> GroupLog:
    log = _logs.get(group)
    if log is None:
        log = _logs[group] = GroupLog(group)
    return log


def note(op: str, tensor: torch.Tensor, group, tag: str, start: float) -> Record:
    """A collective is about to be issued: number it and fold it into its log."""
    log = log_for(group)
    log.seq += 1
    rec = Record(log, log.seq, op, tag, str(tensor.dtype).replace("torch.", ""),
                 tensor.numel(), tensor.numel() * tensor.element_size(), start)
    log.fold(rec)
    return rec


def reset() -> None:
    """Forget every log (a new process group, e.g. after an elastic restart)."""
    _logs.clear()


# ------------------------------------------------------------ whole numbers that sum exactly
DIGITS = 4
SLOTS = 1 + 2 * DIGITS  # enabled flag, then (digit, digit squared) per digit


def digit_bits(world: int) -> int:
    """Bits per digit such that a digit's square summed over ``world`` ranks stays
    below 2**24 (float32's exact-integer range: the header may ride in a float32
    bucket)."""
    return max(1, min(10, (24 - max(1, world).bit_length()) // 2))


def encode_values(value: int, world: int, enabled: bool) -> list[float]:
    """``value`` (any int) as the enabled flag, then DIGITS digits and their squares."""
    bits = digit_bits(world)
    mask = (1 << bits) - 1
    vals = [1.0 if enabled else 0.0]
    for i in range(DIGITS):
        d = (value >> (i * bits)) & mask
        vals += [float(d), float(d * d)]
    return vals


def encode(value: int, world: int, enabled: bool, out: torch.Tensor) -> None:
    """:func:`encode_values` into ``out`` (SLOTS)."""
    out.copy_(torch.tensor(encode_values(value, world, enabled), dtype=out.dtype))


def agree(summed: list[float], world: int) -> bool:
    """From the summed slots: did every rank write the same digits? (All d_r equal
    exactly when world * sum(d_r**2) == sum(d_r)**2, by Cauchy-Schwarz.)"""
    for i in range(DIGITS):
        s1, s2 = int(round(summed[1 + 2 * i])), int(round(summed[2 + 2 * i]))
        if world * s2 != s1 * s1:
            return False
    return True


def mix(*values: int) -> int:
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & MASK)) * 0x100000001B3) & MASK
        h ^= h >> 29
    return h
