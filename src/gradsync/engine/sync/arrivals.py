"""When is a parameter's gradient complete in a synchronised backward?

Usually at its first arrival: autograd sums every use of a parameter inside the
graph before its AccumulateGrad node runs, so the post-accumulate hook fires once
per backward however often the forward used it. Reentrant activation
checkpointing breaks that: each checkpointed segment runs a backward of its own,
so a module checkpointed twice in one forward accumulates twice, and a bucket
launched at the first arrival would miss the second.

torch DDP supports this only with ``static_graph=True`` (every iteration uses the
parameters the same way), and so does gradsync, the way DDP's static graph does
it: the first synchronised backward launches nothing until it ends and counts
each parameter's arrivals; from then on a parameter is complete at that many arrivals, and its
bucket launches as soon as every parameter in it is. Without ``static_graph`` a
second arrival is an error naming the parameter (DDP's "marked ready twice").

Also kept here: the order in which parameters completed in the first synchronised
backward, from which DataParallel rebuilds its buckets once.
"""

from __future__ import annotations

from ...errors import UsageError


class Arrivals:
    """Per synchronised pass: arrivals per parameter against what completes it."""

    def __init__(self, names: list[str], static_graph: bool):
        self.names = names
        self.static_graph = bool(static_graph)
        self.expected: list[int] | None = None if static_graph else [1] * len(names)
        self.count = [0] * len(names)
        self._log: list[int] | None = None

    def open(self, log_order: bool) -> None:
        """A synchronised pass begins; ``log_order``: record completion order (rebuild)."""
        self.count = [0] * len(self.names)
        self._log = [] if log_order else None

    def arrive(self, i: int) -> bool:
        """Parameter ``i``'s gradient arrived; True when it is now complete."""
        self.count[i] += 1
        if self._log is not None:
            self._log.append(i)
        if self.expected is None:
            return False
        if self.count[i] == self.expected[i]:
            return True
        if self.count[i] > self.expected[i]:
            hint = ("every iteration must use the parameters as the first one did"
                    if self.static_graph else
                    "with reentrant activation checkpointing of a module used more than once, "
                    "pass static_graph=True (as torch DDP requires) or use "
                    "torch.utils.checkpoint(..., use_reentrant=False)")
            raise UsageError(f"parameter {self.names[i]!r} received its gradient "
                             f"{self.count[i]} times in one backward (expected "
                             f"{self.expected[i]}): {hint}")
        return False

    def incomplete(self) -> list[int]:
        """Parameters not complete at the end of the pass (launched then, as they are)."""
        if self.expected is None:
            return list(range(len(self.names)))
        return [i for i, (c, e) in enumerate(zip(self.count, self.expected)) if c < e]

    def never_arrived(self) -> list[int]:
        return [i for i, c in enumerate(self.count) if c == 0]

    def close(self) -> list[int] | None:
        """The pass completed: learn the counts (static graph); return the completion
        order when it was recorded (each parameter at its last arrival)."""
        if self.expected is None:
            self.expected = [max(1, c) for c in self.count]
        log, self._log = self._log, None
        if log is None:
            return None
        last = {i: k for k, i in enumerate(log)}
        order = sorted(last, key=last.get)
        return order + [i for i in range(len(self.names)) if i not in last]

    def abandon(self) -> None:
        """The pass failed: forget its order (counts restart at the next open)."""
        self._log = None
