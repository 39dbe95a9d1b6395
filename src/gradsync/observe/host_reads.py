"""Count the host reads of device values a step makes (``GRADSYNC_HOST_READS=1``).

On a GPU each read of a value -- ``.item()``, ``.tolist()``, ``float(t)``,
``int(t)``, ``bool(t)`` (an ``if`` on a tensor), ``.numpy()``, ``.cpu()`` --
waits for every kernel queued before it: the host stops feeding the device. A
training step should read once, at its end. There is no GPU here, so the count is
taken on the CPU path, where the same calls run: a ``TorchFunctionMode`` sees
every one (also inside torch's own Python, e.g. an optimizer that reads), and a
test holds the number per step so it cannot grow unnoticed. On the CPU it counts
calls that would read on a GPU; reads of tensors that live on the host there too
(a batch's item count before its copy, the step's figures after their one read)
are counted as well, so it errs on the high side. Not counted: torch's optimizers
reading their ``step`` counters (host tensors on a GPU too, unless capturable), and
anything inside autograd's backward (its callbacks run outside the mode): the
engine's own reads go through ``engine/transport/host.py``, which counts them
(``host.reads``), and the step's figure adds those.
"""

from __future__ import annotations

import os
import sys

from torch.overrides import TorchFunctionMode

ENV = "GRADSYNC_HOST_READS"
READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__",
                   "numpy", "cpu"})


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads:`` ... ``reads.count``; ``reads.by_call`` per call name."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_call: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and not _in_optimizer():
            self.count += 1
            self.by_call[name] = self.by_call.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _in_optimizer() -> bool:
    """Is the read torch.optim's own (its host-side ``step`` counters)?"""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if f"torch{os.sep}optim{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False
