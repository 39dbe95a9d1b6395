"""Gathering and freeing stage-3 units: when a unit's full parameters exist.

A unit's gathered buffer is the dominant transient memory of ZeRO-3 (arXiv
1910.02054, section 5.3), so it exists only between a gather and the matching
free. Gathers are issued on one process group in one order on every rank
(forward in registration order, backward in reverse), prefetched ``prefetch``
units ahead so communication overlaps compute; storage is re-filled in place, so
tensors autograd saved during forward see the values again in backward.

A rank with no data (``backward(None, num_items=0)`` without a forward) must issue
the same gathers as the others. The gatherer records the order in which it
launched gathers in this rank's last training forward and the backward after it,
and the replay repeats exactly that order: it holds for a forward whose unit order
differs from registration order, or that calls a unit twice. Before any recording
it assumes registration order.
"""

from __future__ import annotations

import contextlib

import torch

from .units import FlatUnit


class UnitGatherer:
    """Gathers, frees and prefetches the units of one FullyShardedDataParallel."""

    def __init__(self, units: list[FlatUnit], comm, group, rank: int, prefetch: int):
        self.units, self.comm, self.group, self.rank = units, comm, group, rank
        self.prefetch = prefetch
        self._trace: list[FlatUnit] | None = None  # launches in the phase being recorded
        self._phase: str | None = None  # "forward" | "backward" | None (not recording)
        self.recorded: dict[str, list[FlatUnit]] = {}  # phase -> its last launch order

    def launch(self, u: FlatUnit) -> None:
        """Start gathering ``u`` unless it is gathered or on its way."""
        if u.gather_pending is not None or u.full.untyped_storage().nbytes():
            return
        full = u.full.data
        full.untyped_storage().resize_(full.numel() * full.element_size())
        u.gather_pending = self.comm.gather(full, u.shard, self.rank, self.group,
                                            tag=f"unit{u.index}")
        if self._trace is not None:
            self._trace.append(u)

    def gather(self, u: FlatUnit, grad: bool) -> None:
        """Make ``u``'s module attributes views of its full parameters (differentiable
        into the flat buffer when ``grad``)."""
        self.launch(u)
        if u.gather_pending is not None:
            u.gather_pending.wait()
            u.gather_pending = None
        with torch.enable_grad() if grad else contextlib.nullcontext():
            # a backward re-gather runs where autograd disabled grad mode; its views must
            # still lead to ``full`` for a reentrant checkpoint recomputing from them
            views = u.param_views(grad)
        for mod, attr, k in u.slots:
            setattr(mod, attr, views[k])

    def free(self, u: FlatUnit) -> None:
        """Release ``u``'s full buffer; a gather still in flight (prefetched for a unit
        the forward then skipped) completes first, it is writing into that storage."""
        if u.gather_pending is not None:
            u.gather_pending.wait()
            u.gather_pending = None
        u.kept = False
        u.full.untyped_storage().resize_(0)
        for mod, attr, k in u.slots:
            setattr(mod, attr, u.freed[k])

    def prefetch_after(self, u: FlatUnit, backward: bool, root: torch.nn.Module) -> None:
        seq = self.units[::-1] if backward else self.units
        pos = seq.index(u)
        for nxt in seq[pos + 1:pos + 1 + self.prefetch]:
            if nxt.module is not root:
                self.launch(nxt)

    def release_all(self) -> None:
        """Free whatever an earlier forward or pass left gathered."""
        for u in self.units:
            if u.full.untyped_storage().nbytes():
                self.free(u)

    # ------------------------------------------------------------------ recording
    def phase(self, name: str) -> None:
        """A training forward outside a pass ("forward") or a pass ("backward") begins.
        Several forwards before one backward, or several passes after one forward,
        extend one recording; a pass with no recorded forward before it is not recorded."""
        if name == self._phase or (name == "backward" and self._phase is None):
            return
        self.close()
        self._phase, self._trace = name, []

    def close(self) -> None:
        """Keep what is being recorded and stop recording."""
        if self._phase is not None:
            self.recorded[self._phase] = self._trace
        self._phase = self._trace = None

    @contextlib.contextmanager
    def paused(self):
        """Launches inside are not recorded (an evaluation forward under no_grad)."""
        trace, self._trace = self._trace, None
        try:
            yield
        finally:
            self._trace = trace

    # ------------------------------------------------------------------ replay
    def replay_forward(self, keep: set[int]) -> None:
        """The gathers of the recorded forward (registration order before any), keeping
        gathered what a forward keeps for its backward (``keep``: unit ids)."""
        self.close()
        self.release_all()
        for u in self.recorded.get("forward", self.units):
            self.gather(u, False)
            if id(u) not in keep:
                self.free(u)

    def replay_backward(self, reduction_order: list[FlatUnit], accept,
                        fallback: list[FlatUnit]) -> None:
        """The gathers of the recorded backward (``fallback`` before any recording),
        interleaved with ``accept(u)`` in reduction order, each after ``u``'s own
        gather: a rank with data launches a unit's reduction only after gathering it,
        so this rank never waits on a reduction the others can only launch after a
        gather it has not issued."""
        self.close()
        seq = self.recorded.get("backward", fallback)
        done = 0
        for u in reduction_order:
            if u in seq[done:]:
                stop = seq.index(u, done) + 1
                for v in seq[done:stop]:
                    self.gather(v, False)
                    self.free(v)
                done = stop
            accept(u)
        for v in seq[done:]:
            self.gather(v, False)
            self.free(v)
        self.release_all()
