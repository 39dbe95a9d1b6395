"""Backward and communication sharing the same cores: the schedule with overlap penalties.

Why: the plain simulator assumes communication overlapped with backward is free,
which holds when a NIC and a DMA engine move the bytes. On CPU with gloo over
loopback the bytes are moved and summed by CPU threads of the same processes, so
on a machine with as many cores as workers (2 here) an all-reduce in flight takes
cycles from backward, and backward takes cycles from it. ``gradsync calibrate``
measures both effects; this module schedules a step with them.

Model (processor sharing, two constants from the profile):

* while an all-reduce is in flight, backward progresses at rate ``1 - f``
  (``overlap_compute_penalty``; 0: free overlap, 1: overlap buys nothing);
* while backward computes, the all-reduce progresses at rate ``1 - g``
  (``overlap_comm_penalty``);
* everything else is the plain simulator's model: reverse list order, buckets
  launched strictly in index order when their last gradient is ready and the
  lane is free, each bucket's work the ring all-reduce cost.

With f = g = 0 this reproduces the plain schedule exactly (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def contended_schedule(work: Sequence[float], start_s: float,
                       bucket_params: Sequence[Sequence[int]],
                       bucket_cost: Sequence[float], f: float, g: float):
    """Event loop; returns (grad spans [(i, start, end)], ready [s], bucket spans [(start, end)]).

    ``work[i]`` is parameter i's backward seconds alone; backward visits
    parameters in reverse index order starting at ``start_s``.
    """
    if not (0 <= f < 1 and 0 <= g < 1):
        raise ValueError(f"overlap penalties must be in [0, 1), got {f} and {g}")
    n = len(work)
    order = list(range(n - 1, -1, -1))
    ready = [math.nan] * n
    pending = [len(ps) for ps in bucket_params]
    owner = {}
    for k, ps in enumerate(bucket_params):
        for i in ps:
            owner[i] = k
    grads, spans = [], [None] * len(bucket_params)
    t = start_s
    ci, c_start = 0, start_s
    crem = work[order[0]] if n else 0.0
    cur, mrem, m_start, nb = None, 0.0, 0.0, 0
    while ci < n or cur is not None or nb < len(bucket_params):
        if cur is None and nb < len(bucket_params) and pending[nb] == 0:
            cur, mrem, m_start, nb = nb, bucket_cost[nb], t, nb + 1
            continue
        computing, comm = ci < n, cur is not None
        if not computing and not comm:
            raise RuntimeError("a bucket never became ready")  # cannot happen: all grads done
        rc = (1.0 - f) if comm else 1.0
        rm = (1.0 - g) if computing else 1.0
        dt_c = crem / rc if computing else math.inf
        dt_m = mrem / rm if comm else math.inf
        dt = min(dt_c, dt_m)
        t += dt
        if computing:
            crem -= dt * rc
        if comm:
            mrem -= dt * rm
        if computing and dt_c <= dt_m:
            i = order[ci]
            grads.append((i, c_start, t))
            ready[i] = t
            if i in owner:
                pending[owner[i]] -= 1
            ci += 1
            c_start = t
            crem = work[order[ci]] if ci < n else 0.0
        if comm and dt_m <= dt_c:
            spans[cur] = (m_start, t)
            cur = None
    return grads, ready, spans
