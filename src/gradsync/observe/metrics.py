"""Per-step communication and memory figures, measured on every step at tiny cost.

Exposed communication is the time the training loop was *blocked* on a
collective: the end of backward waiting for buckets still in flight, plus every
synchronous collective (buffer broadcasts, the step's statistics gather, a drift
check). It is read from the collective events' ``waited_s`` through
:mod:`gradsync.engine.transport.comm`'s observer door, so it needs no tracer and no extra
synchronisation; compute time is the step time minus it. Communication hidden
behind backward costs nothing here, which is the point of overlapping
(DDP paper, arXiv 2006.15704, section 3.2.3).
"""

from __future__ import annotations

import resource
import sys

import torch

from ..engine.transport import comm


class StepMeter:
    """Sums bytes sent and time blocked on collectives since the last ``reset()``.

    Blocked: on the CPU the host's wait; on a GPU the compute stream's stall, timed by
    CUDA events around the wait (the host returns from a NCCL wait at once, so its
    clock measured enqueueing). Events are read without blocking: a stall whose events
    have not completed when the step's figures are taken counts in the next step's.
    """

    def __init__(self):
        self.bytes = 0
        self._exposed = 0.0
        self._unread: list[comm.CollectiveEvent] = []
        self.collectives = 0
        self._handle = comm.add_observer(self._on_comm)

    def _on_comm(self, kind: str, ev: comm.CollectiveEvent) -> None:
        if kind == "complete":
            self.bytes += ev.nbytes
            if ev.gpu_wait is None:
                self._exposed += ev.waited_s
            else:
                self._unread.append(ev)
            self.collectives += 1

    @property
    def exposed_s(self) -> float:
        waiting = []
        for ev in self._unread:
            s = ev.stream_wait_s()
            if s is None:
                waiting.append(ev)
            else:
                self._exposed += s
        self._unread = waiting
        return self._exposed

    def reset(self) -> None:
        self.bytes, self._exposed, self.collectives = 0, 0.0, 0

    def close(self) -> None:
        self._handle.remove()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on a GPU, peak resident set on the CPU.

    ``tracemalloc`` would be exact for Python objects but slows every allocation;
    the kernel's max RSS is free and includes tensors, the interpreter and gloo's
    buffers -- what an out-of-memory killer would see.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
