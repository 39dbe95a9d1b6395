"""Alpha-beta cost of the collectives data parallelism uses.

A message of n bytes costs ``alpha + n * beta`` (Hockney's model; beta = 1 /
bandwidth). Collective costs follow Thakur, Rabenseifner and Gropp 2005
("Optimization of Collective Communication Operations in MPICH"):

* ring reduce-scatter and all-gather: (N-1) messages of S/N bytes each:
  ``(N-1)*alpha + (N-1)/N * S * beta``;
* ring all-reduce = reduce-scatter + all-gather: ``2(N-1)*alpha + 2(N-1)/N*S*beta``
  -- each worker moves about 2S regardless of N, which is why it replaced the
  parameter server (Li et al., OSDI 2014; ring all-reduce: Patarasuk & Yuan 2009);
* tree all-reduce (pipelined double binary tree, as NCCL's trees): latency
  ``2*ceil(log2 N)*alpha``, bandwidth term as the ring's;
* hierarchical all-reduce with ``g`` workers per node and M = N/g nodes: an
  intra-node reduce to the node leader (reduce-scatter + gather, ``2(g-1)`` alphas
  and ``2(g-1)/g*S`` bytes at intra-node bandwidth), a ring all-reduce over the
  M leaders at inter-node bandwidth, then an intra-node broadcast (scatter +
  all-gather, same cost as the reduce). It saves latency (2(M-1) inter-node
  alphas instead of 2(N-1)) but still sends the whole S around the leaders' ring,
  so on bandwidth-bound messages it is no faster than a flat ring whose slowest
  link is the inter-node one. The bandwidth-optimal variant (each of a node's
  g workers carries 1/g of the data across nodes in parallel), which
  ``engine.algorithms.hierarchical`` runs, is priced round by round with separate
  intra- and inter-host links in ``plan.two_level``;
* parameter server: the server's ingress link carries one gradient from every
  worker, ``alpha + N*S*beta`` (egress back to the workers costs the same again).

Per-step volume (ZeRO paper, arXiv 1910.02054, section 7): DP and ZeRO-1/2 move
2P elements per worker (all-reduce, or reduce-scatter + all-gather), ZeRO-3 moves
3P (an extra parameter all-gather in backward).

Units: bytes and bytes/second, with GB = 10^9 bytes (see ``plan.units``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError


def _check(nbytes: float, n: int, alpha: float, bw: float) -> None:
    if nbytes < 0:
        raise UsageError(f"message size must be >= 0 bytes, got {nbytes}")
    if n < 1:
        raise UsageError(f"worker count must be >= 1, got {n}")
    if alpha < 0:
        raise UsageError(f"latency must be >= 0, got {alpha}")
    if bw <= 0:
        raise UsageError(f"bandwidth must be > 0, got {bw}")


def ring_allreduce_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    _check(nbytes, n, alpha, bw)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def reduce_scatter_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    _check(nbytes, n, alpha, bw)
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


all_gather_time = reduce_scatter_time  # same schedule run backwards


def tree_allreduce_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    _check(nbytes, n, alpha, bw)
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * (n - 1) / n * nbytes / bw


def hierarchical_allreduce_time(
    nbytes: float, n: int, per_node: int, intra_bw: float, inter_bw: float, alpha: float = 0.0
) -> float:
    """Reduce to node leaders, ring over leaders, broadcast inside nodes."""
    _check(nbytes, n, alpha, inter_bw)
    _check(nbytes, per_node, alpha, intra_bw)
    if n % per_node:
        raise UsageError(f"{n} workers do not divide into nodes of {per_node}")
    g, m = per_node, n // per_node
    intra = 2 * (g - 1) * alpha + 2 * (g - 1) / g * nbytes / intra_bw
    return 2 * intra + ring_allreduce_time(nbytes, m, inter_bw, alpha)


def ps_ingress_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    _check(nbytes, n, alpha, bw)
    return alpha + n * nbytes / bw


def step_volume_bytes(grad_bytes: float, n: int, zero3: bool = False) -> float:
    """Bytes each worker sends per step: 2(N-1)/N * S for DP/ZeRO-1/2, 3(N-1)/N * S for ZeRO-3."""
    return (3 if zero3 else 2) * (n - 1) / n * grad_bytes


@dataclass(frozen=True)
class CommRow:
    workers: int
    ring_s: float
    tree_s: float
    reduce_scatter_s: float
    all_gather_s: float
    hierarchical_s: float | None
    ps_ingress_s: float
    dp_volume_bytes: float
    zero3_volume_bytes: float
    zero3_s: float  # ring reduce-scatter + two all-gathers of the parameters


@dataclass(frozen=True)
class CommPlan:
    num_params: int
    itemsize: int
    grad_bytes: float
    bandwidth: float
    alpha: float
    per_node: int | None
    intra_bandwidth: float | None
    rows: tuple[CommRow, ...]
    notes: tuple[str, ...] = ()  # where itemsize, bandwidth and alpha came from (assumptions)


def link_from_profile(alpha_per_allreduce: float, beta_s_per_byte: float,
                      world_size: int) -> tuple[float, float]:
    """(alpha per message, link bandwidth) from ``gradsync calibrate``'s profile.

    The profile charges one all-reduce ``alpha + 2(N-1)/N * bytes * beta`` (beta per byte
    of the link, ``calibrate.collectives``), so its beta is this model's 1/bandwidth
    as it is; its alpha is per *all-reduce*, which this model's ring spends in 2(N-1)
    messages at the calibrated N: alpha per message = alpha / (2(N-1)). A profile
    measured on one process has no messages to learn from and is refused.
    """
    if world_size < 2:
        raise UsageError(f"the profile was measured on {world_size} process; latency needs "
                         "two or more (gradsync calibrate --workers 2)")
    if beta_s_per_byte <= 0:
        raise UsageError("the profile's link has no bandwidth figure (beta 0); re-run "
                         "gradsync calibrate")
    return alpha_per_allreduce / (2 * (world_size - 1)), 1.0 / beta_s_per_byte


def plan_comm(
    num_params: int,
    itemsize: int,
    workers: list[int],
    bandwidth: float,
    alpha: float = 0.0,
    per_node: int | None = None,
    intra_bandwidth: float | None = None,
) -> CommPlan:
    """Costs of every pattern for each worker count (``bandwidth`` is inter-node)."""
    if num_params <= 0:
        raise UsageError(f"parameter count must be > 0, got {num_params}")
    if itemsize <= 0:
        raise UsageError(f"bytes per element must be >= 1, got {itemsize}")
    if not workers or any(w < 1 for w in workers):
        raise UsageError(f"worker counts must be >= 1, got {workers}")
    if per_node is not None and per_node < 1:
        raise UsageError(f"workers per node must be >= 1, got {per_node}")
    S = float(num_params) * itemsize
    rows = []
    for n in workers:
        hier = None
        if per_node is not None and n % per_node == 0:
            hier = hierarchical_allreduce_time(
                S, n, per_node, intra_bandwidth or bandwidth, bandwidth, alpha
            )
        rs = reduce_scatter_time(S, n, bandwidth, alpha)
        ag = all_gather_time(S, n, bandwidth, alpha)
        rows.append(
            CommRow(
                workers=n,
                ring_s=ring_allreduce_time(S, n, bandwidth, alpha),
                tree_s=tree_allreduce_time(S, n, bandwidth, alpha),
                reduce_scatter_s=rs,
                all_gather_s=ag,
                hierarchical_s=hier,
                ps_ingress_s=ps_ingress_time(S, n, bandwidth, alpha),
                dp_volume_bytes=step_volume_bytes(S, n),
                zero3_volume_bytes=step_volume_bytes(S, n, zero3=True),
                zero3_s=rs + 2 * ag,
            )
        )
    return CommPlan(
        int(num_params), int(itemsize), S, bandwidth, alpha, per_node, intra_bandwidth, tuple(rows)
    )
