"""Per-step communication and memory figures, measured on every step at tiny cost.

Exposed communication is the time the training loop was *blocked* on a
collective: the end of backward waiting for buckets still in flight, plus every
synchronous collective (buffer broadcasts, the step's statistics gather, a drift
check). It is the :class:`~gradsync.engine.transport.busy_clock.BusyClock`'s blocked
time (read from the collective events through :mod:`gradsync.engine.transport.comm`'s
observer door, GPU stalls timed by CUDA events), so it needs no tracer and no extra
synchronisation; compute time is the step time minus it. Communication hidden behind
backward costs nothing here, which is the point of overlapping (DDP paper, arXiv
2006.15704, section 3.2.3).
"""

from __future__ import annotations

import resource
import sys

import torch

from ..engine.transport.busy_clock import BusyClock


class StepMeter(BusyClock):
    """Bytes sent, collectives completed and time blocked on them since the last ``reset()``.

    The blocked time is the :class:`BusyClock`'s (the host's wait on the CPU, the compute
    stream's stall on a GPU); this adds what a step's record counts besides it.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.collectives = 0

    def completed(self, ev) -> None:
        self.bytes += ev.nbytes
        self.collectives += 1

    @property
    def exposed_s(self) -> float:
        """Seconds blocked in collectives since the last :meth:`reset`."""
        return self.blocked_s

    def reset(self) -> None:
        self.start()
        self.bytes, self.collectives = 0, 0


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
