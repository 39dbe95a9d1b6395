"""Pure bucket planning: which gradients travel together in one collective.

This is the one function that decides bucket boundaries. The engine calls it to
lay out its flat gradient buffers and the planner's simulator calls it to predict
a step, so a picture of the schedule is a picture of what runs.

Why buckets at all (DDP paper, arXiv 2006.15704, section 3.2.3): one collective
per parameter pays the per-message latency hundreds of times; one collective for
the whole model cannot start until backward ends. Buckets sit between the two.

Rules, in order:

* Parameters are visited in the order their gradients are expected to become
  ready. Before any backward has run that is reverse registration order (the
  output layer's gradients are produced first); after the first iteration the
  engine passes the order it observed.
* Parameters of different dtypes never share a bucket (one flat buffer per
  bucket, one dtype per buffer).
* A parameter is never split. A bucket takes the next parameter while its size
  stays within the cap; otherwise the bucket closes and a new one starts. A single
  parameter larger than the cap gets a bucket of its own. So, unlike DDP, which
  closes a bucket only once it has *reached* the cap, a bucket here never exceeds
  the cap unless it holds exactly one parameter.
* The first bucket of each dtype uses the smaller ``first_bucket_bytes`` cap so
  the first collective launches early in backward.
* Buckets are numbered in the order they are expected to become ready (the
  position of their last parameter in the visiting order). The engine launches
  them strictly in this order on every rank, which is what keeps collectives
  matched across ranks even when gradients arrive in a different order.

No torch import here: the planner uses this on parameter counts alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What bucketing needs to know about one parameter."""

    name: str
    numel: int
    itemsize: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"parameter {self.name!r}: numel must be >= 0, got {self.numel}")
        if self.itemsize <= 0:
            raise ValueError(f"parameter {self.name!r}: itemsize must be > 0, got {self.itemsize}")

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: indices into the parameter list, in the order they fill the buffer."""

    index: int
    params: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int


def mb_to_bytes(mb: float) -> int:
    """Megabytes as DDP counts them (MiB) to bytes; rejects non-positive sizes."""
    if not mb > 0:
        raise ValueError(f"bucket size must be > 0 MB, got {mb}")
    return max(1, int(mb * MB))


def default_order(n_params: int) -> list[int]:
    """Reverse registration order: the gradients of the last layer arrive first."""
    return list(range(n_params - 1, -1, -1))


def plan_buckets(
    params: Sequence[ParamSpec],
    bucket_cap_bytes: int,
    first_bucket_bytes: int,
    order: Sequence[int] | None = None,
) -> list[BucketSpec]:
    """Assign every parameter to exactly one bucket.

    ``order`` is the expected gradient-ready order (indices into ``params``); by
    default reverse registration order. Returns buckets numbered in launch order.
    """
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be > 0, got {bucket_cap_bytes}")
    if first_bucket_bytes <= 0:
        raise ValueError(f"first_bucket_bytes must be > 0, got {first_bucket_bytes}")
    n = len(params)
    order = default_order(n) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of the parameter indices")

    first_cap = min(first_bucket_bytes, bucket_cap_bytes)
    open_buckets: dict[str, list[int]] = {}
    open_bytes: dict[str, int] = {}
    seen_dtype: set[str] = set()
    closed: list[list[int]] = []

    for i in order:
        p = params[i]
        members = open_buckets.get(p.dtype)
        if members:
            cap = bucket_cap_bytes if p.dtype in seen_dtype else first_cap
            if open_bytes[p.dtype] + p.nbytes > cap:
                closed.append(members)
                seen_dtype.add(p.dtype)
                members = None
        if not members:
            members = []
            open_buckets[p.dtype] = members
            open_bytes[p.dtype] = 0
        members.append(i)
        open_bytes[p.dtype] += p.nbytes
    closed.extend(m for m in open_buckets.values() if m)

    position = {idx: pos for pos, idx in enumerate(order)}
    closed.sort(key=lambda members: position[members[-1]])
    return [
        BucketSpec(
            index=k,
            params=tuple(members),
            dtype=params[members[0]].dtype,
            numel=sum(params[i].numel for i in members),
            nbytes=sum(params[i].nbytes for i in members),
        )
        for k, members in enumerate(closed)
    ]
