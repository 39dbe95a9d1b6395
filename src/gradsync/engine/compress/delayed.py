"""Compressed gradients applied one step late, so their communication crosses the step boundary.

``CompressedBuckets(compressor, delay=1)`` (``gradsync train --compress int8
--compress-delay 1``). Without a delay the optimizer waits at the end of every
backward for the last bucket's compressed sum. With one, step s's buckets are
copied aside as they become ready and handed to the compression thread, nobody
waits for them, and the end of step s's backward puts step s-1's sum (finished
meanwhile) into ``.grad``: the communication of step s runs during the optimizer
step and step s+1's forward and backward. This is the one-step-stale gradient of
pipelined data parallelism (the delayed SGD analysed by Stich & Karimireddy,
arXiv 1909.05350, with error feedback: the delay enters only the lower-order terms of
the rate). It is opt-in because it still changes the trajectory.

What stays exact, and what was decided (docs/slow_links.md, "Delayed updates"):

* the gradient applied at step s is step s-1's compressed sum divided by step
  s-1's exact global item count (the header is summed at step s-1, synchronously,
  as before), bitwise the same on every rank; error feedback stays per rank;
* the first step applies nothing: every ``.grad`` is left None, so the optimizer
  skips every parameter (no weight decay, no momentum, no Adam step count). The
  other choice, step 1 applying its own gradient synchronously, would leave
  step 2 with nothing to apply (or step 1's again): a gap is unavoidable when a
  pipeline fills, and at the start it costs no extra communication;
* :meth:`DelayedSums.flush` applies the last pending sum (the strategy's
  ``finish()`` does, with one more optimizer step), so every step's gradient is
  applied exactly once;
* the pending sum (a global sum, identical on every rank) is checkpoint state,
  per parameter so it survives a change of bucket layout: a run resumed from step
  s applies step s's gradient at step s+1, as the uninterrupted run does;
* the first ``exact_windows`` windows are summed exactly and synchronously, but
  applied one step late like the others, so the trajectory has one shape from
  step 1 on.

Costs two gradient-sized buffers (one sum in flight, one being applied).

What ``--compress-delay 1`` asks of the strategy around the delayed sums
(:class:`DelayedUpdates`): the loop does not change; :class:`CompressedStrategy`
(``strategy/inexact.py``) takes this mixin, which

* flushes at the end (:meth:`finish`): the last step's sum is waited for and
  applied with one more optimizer step, clipped to the same ``--clip`` the loop
  used, and skipped (on every rank alike: the sum is the same everywhere) if it is
  not finite -- so every step's gradient is applied once, none dropped;
* checkpoints the pending sum (:meth:`extra_state`: identical on every rank, so
  rank 0's copy is the state) after waiting for its communication, which also
  makes the gathered residuals those after that sum (:meth:`gather_state`);
* reports which step's gradient the update applied (``grad_steps``: [] at the
  first step, [s-1] at step s, [T-1, T] at the last one, where the flush adds T),
  and the bytes and probe distance of that gradient, so metrics and the probe
  line up with what the optimizer saw.

Clipping and ``--on-nonfinite`` act on the gradient in ``.grad``, which is the
applied (previous step's) one; that is the one they protect the model from.
``--probe-every`` works unchanged: a probed step's exact sum travels with its
compressed one and is compared when both are applied.
"""

from __future__ import annotations

import math

import torch

from ...errors import UsageError
from ..transport import comm
from .base import gradient_distance, ring_bytes


class _Part:
    """A contiguous run of parameters' gradient sums: ``params`` (trainable indices) in
    ``buf`` back to back; ``spec`` the bucket it was, when it was one."""

    __slots__ = ("params", "buf", "spec", "exact")

    def __init__(self, params, buf, spec=None, exact=None):
        self.params, self.buf, self.spec, self.exact = tuple(params), buf, spec, exact


class _Window:
    """One synchronised window's sum, waiting to be applied."""

    __slots__ = ("number", "parts", "handles", "divisor", "used", "sent", "sent_total")

    def __init__(self, number, parts, handles, divisor, used, sent=0):
        self.number, self.parts, self.handles = number, parts, handles
        self.divisor, self.used, self.sent = float(divisor), list(used), sent
        self.sent_total: int | None = None  # the compressor's counter after this window


def _done() -> comm.Pending:
    """A Pending that is already complete: the core has nothing to wait for."""
    return comm.Pending(None, None)


class DelayedSums:
    """The delayed path of a :class:`~gradsync.engine.compress.reduction.CompressedBuckets`
    (``red``): its ``communicate`` and ``complete`` hand over to :meth:`launch` and
    :meth:`complete` when ``delay`` is 1."""

    def __init__(self, red):
        self.red = red
        self._open: list[_Part] = []  # this window's buckets, in flight
        self._handles: list[comm.Pending] = []
        self.pending: _Window | None = None  # summed (or being summed), not yet applied
        self._pool: dict = {}  # BucketSpec -> spare buffers
        self._counted = 0  # the compressor's sent-bytes counter at the last applied window
        self.applied: list[int] = []  # windows applied since the last report (1-based)
        self.applied_sent = 0  # their bytes

    # ------------------------------------------------------------- during backward
    def _buffer(self, spec, src: torch.Tensor) -> torch.Tensor:
        spare = self._pool.get(spec)
        buf = spare.pop() if spare else torch.empty_like(src)
        return buf.copy_(src)

    def _release(self, part: _Part) -> None:
        if part.spec is not None and part.spec in self.red.dp.bucket_plan:
            self._pool.setdefault(part.spec, []).append(part.buf)

    def launch(self, bucket, src) -> comm.Pending:
        """Copy the ready bucket aside and start its compressed sum; wait for nothing."""
        red = self.red
        buf = self._buffer(bucket.spec, src)
        exact = buf.clone() if red.probing() else None
        key = bucket.spec.index
        self._handles.append(red.compressed_sum_(key, buf, [p.shape for p in bucket.params]))
        if exact is not None:
            self._handles.append(red.probe_sum_(key, exact))
        self._open.append(_Part(bucket.spec.params, buf, bucket.spec, exact))
        return _done()

    # ------------------------------------------------------------- end of the window
    def complete(self, divisor: float, used: list[bool]) -> None:
        """The window is closed (header summed): keep its sum, apply the previous one."""
        red, dp = self.red, self.red.dp
        number = red.windows + 1
        if red.windows < red.exact_windows:  # summed already, in place (waited in collect)
            parts = [_Part(b.spec.params, self._buffer(b.spec, red.window_sum(b.spec.index)),
                           b.spec) for b in dp.buckets]
            sent = sum(ring_bytes(b.spec.nbytes, dp.world_size) for b in dp.buckets)
            current = _Window(number, parts, [], divisor, used, sent)
        else:
            current = _Window(number, self._open, self._handles, divisor, used)
            # after the window's last bucket on the same thread: the bytes it sent
            current.handles.append(red.after_sums(self._mark, current))
        self._open, self._handles = [], []
        held = red.close_window()
        red.windows += 1
        previous, self.pending = self.pending, current
        if previous is None:
            self._nothing(held)
            return
        self._write(previous)
        red.restore(previous.used, held)  # rule 1 by the applied window's mask; rule 2 as ever

    def _mark(self, window: _Window) -> None:
        window.sent_total = self.red.compressor.stats().sent_bytes

    def _nothing(self, aside: dict) -> None:
        """The first window: no earlier sum. Gradients as they were before the window
        (``aside``: what was set aside from them, rule 2)."""
        dp = self.red.dp
        params = dp.trainable_params
        for p in params:
            p.grad = None
        for i, (g, copy) in aside.items():
            if copy is None:
                params[i].grad = g
            else:
                bucket, slot = dp.where(i)
                bucket.views[slot].copy_(copy)
                params[i].grad = bucket.views[slot]

    def settle(self) -> None:
        """Wait for the pending window's communication (a checkpoint reads the residuals)."""
        if self.pending is not None:
            self._wait(self.pending)

    def _wait(self, win: _Window) -> None:
        """Windows are waited for in order, so the counter's rise since the last one is
        this window's bytes."""
        for h in win.handles:
            h.wait()  # re-raises what the thread raised
        win.handles = []
        if win.sent_total is not None:
            win.sent, win.sent_total = max(0, win.sent_total - self._counted), None
            self._counted += win.sent

    def _write(self, win: _Window) -> None:
        """``.grad`` = ``win``'s sum / its item count, in the bucket layout of now."""
        self._wait(win)
        probes = [p for p in win.parts if p.exact is not None]
        if probes:  # the whole gradient, compressed vs exact (both still sums)
            self.red.last_distance = gradient_distance(
                [p.buf[:p.spec.numel] for p in probes], [p.exact[:p.spec.numel] for p in probes])
        dp = self.red.dp
        buckets = dp.buckets
        for part in win.parts:
            part.buf.div_(win.divisor)
            idx = part.spec.index if part.spec is not None else -1
            if 0 <= idx < len(buckets) and buckets[idx].spec == part.spec:
                n = part.spec.numel
                buckets[idx].buffer[:n].copy_(part.buf[:n])
            else:  # the layout changed since (the rebuild after window 1; a resume)
                offset = 0
                for i in part.params:
                    bucket, slot = dp.where(i)
                    view = bucket.views[slot]
                    view.copy_(part.buf[offset:offset + view.numel()].view_as(view))
                    offset += view.numel()
            self._release(part)
        self.applied.append(win.number)
        self.applied_sent += win.sent

    # ------------------------------------------------------------- outside a window
    def flush(self) -> bool:
        """Replace ``.grad`` by the pending sum (None for a parameter no rank used in its
        window); False when nothing is pending. Call it outside a backward."""
        win, self.pending = self.pending, None
        if win is None:
            return False
        self._write(win)
        dp = self.red.dp
        for i, p in enumerate(dp.trainable_params):
            bucket, slot = dp.where(i)
            bucket.zeroed = False
            p.grad = bucket.views[slot] if win.used[i] else None
        return True

    def take_applied(self) -> tuple[list[int], int]:
        """(windows applied, their bytes) since the last call."""
        out = (self.applied, self.applied_sent)
        self.applied, self.applied_sent = [], 0
        return out

    def reset(self) -> None:
        """A sync failed: this window's sums are dropped (the pending one stays). Their
        buffers are not reused: the thread may still be writing them."""
        self._open, self._handles = [], []

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict | None:
        """The pending window per parameter (trainable order), or None. Identical on
        every rank: a global sum, its exact item count, its used mask."""
        self.settle()
        win = self.pending
        if win is None:
            return None
        params = self.red.dp.trainable_params
        sums: list[torch.Tensor | None] = [None] * len(params)
        for part in win.parts:
            offset = 0
            for i in part.params:
                n = params[i].numel()
                sums[i] = part.buf[offset:offset + n].clone()
                offset += n
        return {"window": win.number, "divisor": win.divisor, "used": list(win.used),
                "sent": win.sent, "sums": sums}

    def load_state_dict(self, state: dict | None) -> None:
        self.pending = None
        if state is None:
            return
        parts = [_Part((i,), s.clone()) for i, s in enumerate(state["sums"]) if s is not None]
        self.pending = _Window(int(state["window"]), parts, [], state["divisor"],
                               state["used"], int(state.get("sent", 0)))


class DelayedUpdates:
    """Mixin of CompressedStrategy (``self.reduction``: its CompressedBuckets)."""

    _max_norm = None  # the loop's --clip, remembered for the flush

    def clip_grad_norm_(self, max_norm):
        self._max_norm = max_norm
        return super().clip_grad_norm_(max_norm)

    def finish(self) -> None:
        """Apply the pending sum of the last step (see the module docstring)."""
        super().finish()
        if self.reduction.delayed is None:
            return
        self.optimizer.zero_grad(set_to_none=True)  # .grad holds the sum already applied
        if self.reduction.flush():
            norm = super().clip_grad_norm_(self._max_norm)
            if math.isfinite(float(norm)):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def gather_state(self) -> None:
        if self.reduction.delayed is not None:
            self.reduction.delayed.settle()  # residuals after the in-flight sums
        super().gather_state()

    def extra_state(self) -> dict:
        state = super().extra_state()
        if self.reduction.delayed is not None:
            state["pending"] = self.reduction.delayed.state_dict()
        return state

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        pending = (state or {}).get("pending")
        if self.reduction.delayed is not None:
            self.reduction.delayed.load_state_dict(pending)
        elif pending is not None:
            raise UsageError(f"the checkpoint holds step {pending['window']}'s compressed "
                             "gradient, not yet applied (it was written with --compress-delay "
                             "1): continue it with --compress-delay 1")

    def delayed_report(self) -> dict:
        """``step_report`` with a delay: the applied step(s), their bytes and probe."""
        steps, sent = self.reduction.delayed.take_applied()
        report = {"sent_bytes": sent, "grad_steps": steps}
        if self.reduction.last_distance is not None:
            report["grad_cosine"], report["grad_rel_error"] = self.reduction.last_distance
            self.reduction.last_distance = None
        return report
