"""The interface every gradient compressor offers, its statistics, and a distance measure.

A compressor reduces one flat buffer of gradients at a time (a bucket of
DataParallel, a pseudo-gradient of DiLoCo) and keeps whatever state it needs per
buffer (residuals for error feedback, PowerSGD's warm-started ``Q``) keyed by an
integer the caller chooses, the bucket index. Contract of ``all_reduce_``:

* ``flat[:T]`` (``T`` = total elements of ``shapes``) holds this rank's local
  contribution, a SUM of per-item gradients; afterwards it holds the approximate
  SUM over ranks, bitwise identical on every rank. ``flat[T:]`` is not touched.
* Blocking. It touches only ``flat`` and the compressor's own state, under the
  compressor's lock, so it may run on a communication thread while the main
  thread runs backward; ``stats()``/``state_dict()`` take the same lock and so
  see a state between two calls, never half of one.
* Every rank calls it with the same keys in the same order (as for any collective).
  From a communication thread, give it a ``group`` no other thread issues
  collectives on meanwhile: PowerSGD all-reduces P and Q, and two threads issuing
  collectives on one group can order them differently on different ranks. (The
  bf16/fp16/int8 messages are point-to-point with their own tags, above
  ``transport/shard_comm.py``'s, so they do not interleave with anything.)
  ``StreamingDiLoCo`` makes such a group with ``dist.new_group``.
* A group of one rank sends nothing and leaves ``flat`` exact.

Exactness is spent on purpose here: only ``none`` (no compressor) is exact, and
``gradsync verify`` checks only that.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..transport import host

_P2P_TAG_BASE = 1 << 24  # above transport/shard_comm.py's tag space [0, 2**24)


@dataclass(frozen=True)
class CompressionStats:
    """What a compressor has sent so far, from this rank's point of view.

    calls: reductions performed (all keys together).
    raw_bytes: bytes of the payloads handed in (elements x element size).
    exact_bytes: what exact all-reduces of those payloads would have put on the wire
        from this rank: 2 (N-1)/N of ``raw_bytes`` (ring or reduce-scatter +
        all-gather, the bandwidth-optimal schedule).
    sent_bytes: bytes this rank actually put on the wire: point-to-point messages
        counted exactly, the exact all-reduces some methods use inside (PowerSGD's
        P and Q) counted as 2 (N-1)/N of their size, like ``exact_bytes``.
    """

    name: str
    calls: int = 0
    raw_bytes: int = 0
    exact_bytes: int = 0
    sent_bytes: int = 0

    @property
    def ratio(self) -> float:
        """exact_bytes / sent_bytes: how many times less this rank sent (nan if nothing)."""
        return self.exact_bytes / self.sent_bytes if self.sent_bytes else math.nan


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``nbytes``."""
    return 0 if world <= 1 else (2 * (world - 1) * nbytes) // world


def payload_numel(flat: torch.Tensor, shapes: Sequence[torch.Size], key) -> int:
    """Total elements of ``shapes``; checks ``key`` and that ``flat`` can hold them (one-line
    errors)."""
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise UsageError(f"compressor key must be an int >= 0 (a bucket index: state is kept "
                         f"and saved per key), got {key!r}")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise UsageError(f"compressor key {key}: flat must be a 1-D tensor, got "
                         f"{type(flat).__name__}{tuple(getattr(flat, 'shape', ()))}")
    if not flat.is_floating_point():
        raise UsageError(f"compressor key {key}: gradients must be floating point, "
                         f"got {flat.dtype}")
    if not flat.is_contiguous():
        raise UsageError(f"compressor key {key}: flat must be contiguous")
    total = sum(math.prod(s) for s in shapes)
    if total > flat.numel():
        raise UsageError(f"compressor key {key}: shapes hold {total} elements but flat has only "
                         f"{flat.numel()}")
    return total


def forget_nonfinite_(state: torch.Tensor | None) -> None:
    """Zero the NaN and infinite entries of a compressor's carried-over state, in place.

    Error feedback carries what one reduction lost into the next. A non-finite
    gradient (one bad batch; ``--on-nonfinite skip-step`` drops that update) would
    leave NaN in the residual, and every later reduction would add it back: each
    following step non-finite too, and skipped, for the rest of the run. The
    non-finite step's own result stays non-finite (it must be seen and skipped);
    what it left in the state is forgotten, so the next step starts clean. One
    elementwise pass on the device, every time: asking first whether the state is
    finite would cost the same pass plus a host read per bucket (a GPU sync).
    """
    if state is not None and state.numel():
        torch.nan_to_num_(state, nan=0.0, posinf=0.0, neginf=0.0)


def held(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


class Compressor:
    """Base class: locking, statistics and the point-to-point tag sequence.

    Subclasses implement ``_reduce(key, x, shapes, group, rank, world)`` (``x`` is
    the payload view ``flat[:T]``; return the bytes this rank sent) and their state.
    """

    name = "?"
    # ``all_reduce_`` reads ``shapes`` as the tensors it compresses (PowerSGD factorises
    # each matrix), so a caller that splits a buffer must split it between tensors;
    # an elementwise codec (bf16/fp16/int8) sets False: any split is as good
    whole_tensors = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self._raw = 0
        self._exact = 0
        self._sent = 0
        self._tags: dict[int, int] = {}

    def all_reduce_(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size],
                    group=None) -> None:
        """Replace ``flat[:T]`` by the approximate sum over ranks (see the module docstring)."""
        total = payload_numel(flat, shapes, key)
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        x = flat[:total]
        with self._lock:
            raw = total * flat.element_size()
            sent = self._reduce(key, x, list(shapes), group, rank, world) if world > 1 else 0
            self._calls += 1
            self._raw += raw
            self._exact += ring_bytes(raw, world)
            self._sent += sent

    def _reduce(self, key, x, shapes, group, rank, world) -> int:
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Bytes of state this rank keeps between reductions (error-feedback residuals,
        PowerSGD's warm-started factors): gradient-sized for int8 and PowerSGD, which a
        memory report counts (issue 37: it said "communication buffers 0.00 MiB")."""
        return 0

    def stats(self) -> CompressionStats:
        with self._lock:
            return CompressionStats(self.name, self._calls, self._raw, self._exact, self._sent)

    def reset_stats(self) -> None:
        with self._lock:
            self._calls = self._raw = self._exact = self._sent = 0

    def _p2p_tag(self, group) -> int:
        """Next point-to-point tag on ``group``; every rank calls in the same order."""
        k = id(group)
        tag = self._tags.get(k, 0)
        self._tags[k] = (tag + 1) % _P2P_TAG_BASE
        return _P2P_TAG_BASE + tag

    # state: per-rank (residuals differ across ranks), saved by every rank
    def state_dict(self) -> dict:
        with self._lock:
            return {"name": self.name, **self._state()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("name") != self.name:
            got = state.get("name") if isinstance(state, dict) else type(state).__name__
            raise UsageError(f"{self.name} compressor cannot load the state of {got!r}")
        with self._lock:
            self._load(state)

    def _state(self) -> dict:
        return {}

    def _load(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def gradient_distance(approx, exact) -> tuple[float, float]:
    """(cosine similarity, ||approx - exact|| / ||exact||) in float64.

    ``approx`` and ``exact``: tensors, or equally long lists of tensors (taken as one
    concatenated vector). A zero ``exact`` gives cosine 1 and error 0 when ``approx``
    is zero too, else cosine 0 and error inf.
    """
    a, e = _flat64(approx), _flat64(exact)
    if a.shape != e.shape:
        raise UsageError(f"gradient_distance: {a.numel()} elements against {e.numel()}")
    na, ne, diff, dot = host.read(torch.stack([a.norm(), e.norm(), (a - e).norm(), a @ e])
                                  ).tolist()  # one read for the four
    if ne == 0.0:
        return (1.0, 0.0) if na == 0.0 else (0.0, math.inf)
    cosine = dot / (na * ne) if na else 0.0
    return cosine, diff / ne


def _flat64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).to(torch.float64)
    parts = [t.detach().reshape(-1).to(torch.float64) for t in x]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
