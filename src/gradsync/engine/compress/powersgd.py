"""PowerSGD: rank-r gradient compression by one step of power iteration (arXiv 1905.13336).

Each gradient matrix M (a parameter viewed as ``shape[0] x rest``) is replaced
by ``P Q^T`` with P of shape n x r and Q of shape m x r (Vogels et al., section 3,
Algorithm 1): ``P = sum_ranks M_i Q``, orthogonalise P (Gram-Schmidt),
``Q = sum_ranks M_i^T P``, result ``P Q^T``. Two exact all-reduces of (n + m) r
numbers replace one of n m. Because P is orthonormalised, scaling the inputs
scales only Q: gradsync hands in sums, not means as torch's hook does, and gets
exactly ``world_size`` times torch's result.

Defaults follow torch's reference hook
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``):
``matrix_approximation_rank=1``, ``min_compression_rate=2`` (a matrix is compressed
only when ``(n + m) r * 2 < n m``; the others and every 1-D tensor are all-reduced
exactly, batched into the same all-reduce as P, which saves one latency over
torch's separate one), error feedback and warm start on (Q of step t starts step
t+1, section 4.2), ``orthogonalization_epsilon=0``, Q initialised from a standard
normal with seeds drawn from ``numpy.random.RandomState(random_seed)`` in the order
keys are first compressed (torch's scheme, so a key's Q matches torch's for the
same bucket; identical on all ranks). Always Gram-Schmidt (torch switches to
Householder QR above rank 2; the results agree up to rounding and column signs,
which ``P Q^T`` does not see). A column that is all zero (an unused parameter) is
left zero instead of becoming NaN. A non-finite gradient leaves its own step
non-finite, but neither the residual nor the warm-started Q (a non-finite Q goes
back to the key's first random draw, chosen on the device: asking the host whether
Q is finite would be a GPU sync per bucket and step): the next step is PowerSGD
from a clean state, not NaN for good.

Differences from torch's hook, both deliberate:

* ``start_iter`` (torch: ``start_powerSGD_iter``, default 1000, minimum 2) counts
  calls per key and defaults to 0: in gradsync the caller decides when compression
  starts (exact all-reduces until DataParallel's bucket rebuild is over), so the
  torch hook's restriction does not apply.
* Error feedback keeps each rank's *own* compression error, ``M_i - P (M_i^T P)^T``
  (Algorithm 2's local decompression), where torch stores ``M_i - mean_j P P^T M_j``.
  The two sum to the same global residual, so the next step's ``P`` and result are
  the same up to rounding (PowerSGD is linear in the sum), but ours is zero for the
  exactly reduced tensors and for gradients of rank <= r, instead of every rank
  carrying its distance from the mean.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..transport import comm
from .base import Compressor, forget_nonfinite_, held, ring_bytes


def orthogonalize_(m: torch.Tensor, epsilon: float = 0.0) -> None:
    """Gram-Schmidt on the columns of every matrix of the batch ``m`` (b x n x r), in place."""
    for i in range(m.shape[2]):
        col = m[:, :, i:i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if epsilon:
            col /= norm + epsilon
        else:
            col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < m.shape[2]:
            rest = m[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def plan_matrices(shapes, rank: int, min_compression_rate: float):
    """Split a bucket's tensors into compressed (offset, n, m, r) and exact (offset, numel).

    Compressed matrices come grouped by shape in order of first appearance, as
    torch's hook orders them (its P/Q layout and random draws follow that order).
    """
    groups: dict[tuple[int, int], list] = {}
    exact, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) else 1
        m = numel // n if n else 0
        r = min(n, m, rank)
        if len(shape) >= 2 and (n + m) * r * min_compression_rate < n * m:
            groups.setdefault((n, m), []).append((offset, n, m, r))
        elif numel:
            exact.append((offset, numel))
        offset += numel
    return [mat for mats in groups.values() for mat in mats], exact


class _KeyState:
    __slots__ = ("signature", "calls", "q", "residual", "first")

    def __init__(self, signature):
        self.signature, self.calls, self.q, self.residual = signature, 0, None, None
        self.first = None  # the first random Q: what a non-finite Q goes back to


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (see module docstring)."""

    name = "powersgd"

    def __init__(self, rank: int = 1, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, start_iter: int = 0,
                 random_seed: int = 0):
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive int, got {rank!r}")
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.epsilon = float(orthogonalization_epsilon)
        self.start_iter = start_iter
        self.random_seed = random_seed
        self._rng = np.random.RandomState(random_seed)
        self._draws = 0
        self._keys: dict[int, _KeyState] = {}

    def wire_bytes(self, shapes, element_size: int, world: int) -> int:
        """Bytes one rank sends for a bucket of ``shapes`` once compression has started."""
        mats, exact = plan_matrices(shapes, self.rank, self.min_compression_rate)
        first = sum(n * r for _, n, _, r in mats) + sum(k for _, k in exact)
        second = sum(m * r for _, _, m, r in mats)
        return sum(ring_bytes(k * element_size, world) for k in (first, second) if k)

    def _new_seed(self) -> int:
        self._draws += 1
        return int(self._rng.randint(1_000_000_000))

    def _reduce(self, key, x, shapes, group, rank, world) -> int:
        signature = (tuple(tuple(s) for s in shapes), x.dtype)
        st = self._keys.get(key)
        if st is None or st.signature != signature:  # new key or new layout: fresh Q, residual
            calls = 0 if st is None else st.calls  # the step count survives a bucket rebuild
            st = self._keys[key] = _KeyState(signature)
            st.calls = calls
        st.calls += 1
        if st.calls <= self.start_iter:
            comm.all_reduce(x, group, tag="compress-powersgd", meta={"key": key, "exact": True})
            return ring_bytes(x.numel() * x.element_size(), world)
        mats, exact = plan_matrices(shapes, self.rank, self.min_compression_rate)
        if self.use_error_feedback:
            if st.residual is None:
                st.residual = torch.zeros_like(x)
            x += st.residual
        p_numel = sum(n * r for _, n, _, r in mats)
        q_numel = sum(m * r for _, _, m, r in mats)
        exact_numel = sum(k for _, k in exact)
        views = [x[o:o + n * m].view(1, n, m) for o, n, m, _ in mats]

        fresh = st.q is None or not self.warm_start
        if fresh:
            st.q = torch.empty(q_numel, dtype=x.dtype, device=x.device)
        qs, ps, off_q, off_p = [], [], 0, 0
        first = torch.empty(exact_numel + p_numel, dtype=x.dtype, device=x.device)
        for _, n, m, r in mats:
            qs.append(st.q[off_q:off_q + m * r].view(1, m, r))
            ps.append(first[exact_numel + off_p:exact_numel + off_p + n * r].view(1, n, r))
            off_q, off_p = off_q + m * r, off_p + n * r
        if fresh and mats:
            gen = torch.Generator().manual_seed(self._new_seed())
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=gen, dtype=x.dtype))
            st.first = st.q.clone()
        for q in qs:
            orthogonalize_(q, self.epsilon)

        # exact tensors and P = M Q travel in one all-reduce
        pos = 0
        for o, k in exact:
            first[pos:pos + k] = x[o:o + k]
            pos += k
        for m_, q, p in zip(views, qs, ps):
            torch.bmm(m_, q, out=p)
        comm.all_reduce(first, group, tag="compress-powersgd", meta={"key": key, "part": "P"})
        sent = ring_bytes(first.numel() * first.element_size(), world)
        pos = 0
        for o, k in exact:
            x[o:o + k] = first[pos:pos + k]
            pos += k
        if self.use_error_feedback:
            st.residual.zero_()
        for p in ps:
            orthogonalize_(p, self.epsilon)
        for m_, p, q, (o, n, m, _) in zip(views, ps, qs, mats):
            torch.bmm(m_.transpose(1, 2), p, out=q)
            if self.use_error_feedback:  # this rank's own error: M_i - P (M_i^T P)^T
                st.residual[o:o + n * m].view(1, n, m).copy_(m_ - torch.bmm(p, q.transpose(1, 2)))
        if mats:
            comm.all_reduce(st.q, group, tag="compress-powersgd", meta={"key": key, "part": "Q"})
            sent += ring_bytes(st.q.numel() * st.q.element_size(), world)
        for m_, p, q in zip(views, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=m_)
        forget_nonfinite_(st.residual)
        if mats and st.first is not None:  # bitwise the same Q everywhere: every rank alike
            st.q.copy_(torch.where(torch.isfinite(st.q.sum()), st.q, st.first))
        return sent

    def held_bytes(self) -> int:
        with self._lock:
            return sum(held(t) for st in self._keys.values() for t in (st.q, st.residual,
                                                                         st.first))

    def _state(self) -> dict:
        keys = {}
        for key, st in self._keys.items():
            keys[key] = {"shapes": [list(s) for s in st.signature[0]],
                         "dtype": str(st.signature[1]), "calls": st.calls,
                         "q": None if st.q is None else st.q.clone(),
                         "residual": None if st.residual is None else st.residual.clone(),
                         "first": None if st.first is None else st.first.clone()}
        return {"rank": self.rank, "random_seed": self.random_seed, "draws": self._draws,
                "keys": keys}

    def _load(self, state: dict) -> None:
        if state.get("rank") != self.rank:
            raise ValueError(f"PowerSGD state is for rank {state.get('rank')}, this compressor "
                             f"has rank {self.rank}")
        self.random_seed = state["random_seed"]
        self._rng = np.random.RandomState(self.random_seed)
        self._draws = 0
        for _ in range(state["draws"]):
            self._new_seed()
        self._keys = {}
        for key, entry in state["keys"].items():
            dtype = getattr(torch, entry["dtype"].replace("torch.", ""))
            st = _KeyState((tuple(tuple(s) for s in entry["shapes"]), dtype))
            st.calls = entry["calls"]
            st.q = None if entry["q"] is None else entry["q"].clone()
            st.residual = None if entry["residual"] is None else entry["residual"].clone()
            first = entry.get("first")
            st.first = first.clone() if first is not None else (
                None if st.q is None else st.q.clone())
            self._keys[int(key)] = st
