"""DataParallel with compressed buckets: a bucket reduction that sends through a compressor.

``gs.DataParallel(module, reduction=CompressedBuckets(parse_compression("int8")))``.
DataParallel keeps its hooks, launch order, item header and ``num_items``
division (``buckets/reduction.py``); only how a ready bucket travels changes:

* the first ``exact_windows`` synchronised windows (default 1) are all-reduced
  exactly: DataParallel rebuilds its buckets once, after its first synchronised
  backward, and a compressor's state (residuals, PowerSGD's Q) belongs to one
  layout; the same rule as torch's ``start_powerSGD_iter`` >= 2;
* afterwards each bucket is handed to the compressor on a communication thread
  over a process group of its own (``thread.py``), so the encoding overlaps the
  rest of backward, and the item header travels separately, exactly.

The gradient DataParallel hands the optimizer is then the compressed sum divided
by the exact global item count. With ``delay=1`` it is the previous window's
(``delayed.py``): nobody waits for a window's compressed sums, which travel
during the next step's forward and backward.
"""

from __future__ import annotations

import torch

from ..buckets.reduction import AllReduceBuckets
from ..transport import comm
from .base import Compressor, gradient_distance
from .delayed import DelayedSums
from .thread import CompressionThread


class CompressedBuckets(AllReduceBuckets):
    """Bucket reduction through ``compressor`` (see the module docstring).

    reduce_dtype: as for :class:`AllReduceBuckets` (compress fp32 sums of a bf16 model).
    comm_group: the compression thread's group (default: a new one with the same ranks).
    delay: 0 (the default: a window's own sum, waited for), or 1 (the previous window's
        sum, applied one step late, its communication overlapped: ``delayed.py``).
    """

    exact_sum = False  # the item header travels separately, exactly

    def __init__(self, compressor: Compressor, exact_windows: int = 1,
                 reduce_dtype: torch.dtype | None = None, comm_group=None,
                 probe_every: int = 0, delay: int = 0):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"CompressedBuckets needs a Compressor, got {type(compressor).__name__}"
                            " (parse_compression('none') is None: use no reduction at all)")
        if isinstance(exact_windows, bool) or not isinstance(exact_windows, int) \
                or exact_windows < 0:
            raise ValueError(f"exact_windows must be an int >= 0, got {exact_windows!r}")
        if delay not in (0, 1) or isinstance(delay, bool):
            raise ValueError(f"delay must be 0 or 1 (steps a compressed sum is applied late), "
                             f"got {delay!r}")
        super().__init__(reduce_dtype)
        self.compressor = compressor
        self.exact_windows = exact_windows
        self.windows = 0  # synchronised windows completed
        self._comm_group = comm_group
        self._thread: CompressionThread | None = None
        self.probe_every = int(probe_every)
        self.last_distance: tuple[float, float] | None = None  # (cosine, relative error)
        self._probes: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.delay = delay
        self.delayed = DelayedSums(self) if delay else None

    def attach(self, dp) -> None:
        super().attach(dp)
        if self._thread is None:
            self._thread = CompressionThread(self.compressor, dp.group, self._comm_group)

    def probing(self) -> bool:
        """This window also sums an exact copy, to measure the distance from exact."""
        w = self.windows - self.exact_windows
        return bool(self.probe_every) and w >= 0 and w % self.probe_every == 0

    def communicate(self, bucket, src):
        if self.windows < self.exact_windows:
            return self.exact_sum_(bucket, src)
        if self.delayed is not None:
            return self.delayed.launch(bucket, src)
        shapes = [p.shape for p in bucket.params]
        exact = src.clone() if self.probing() else None
        pending = self.compressed_sum_(bucket.spec.index, src, shapes)
        if exact is None:
            return pending
        self._probes[bucket.spec.index] = (src, exact, bucket.spec.numel)
        return self.probe_sum_(bucket.spec.index, exact)

    def exact_sum_(self, bucket, src):
        """An exact window's bucket: the backend's all-reduce (a subclass: its own exact sum)."""
        return super().communicate(bucket, src)

    def compressed_sum_(self, key: int, src, shapes):
        """A compressed window's bucket, on the compression thread."""
        return self._thread.launch(key, src, shapes)

    # ------------------------------------------------ the delayed path's hooks (delayed.py)
    def probe_sum_(self, key: int, exact: torch.Tensor) -> comm.Pending:
        """The exact sum of a probe's copy, on the thread after the compressed sum: waiting
        for it waits for both."""
        return self._thread.submit(comm.all_reduce, exact, self._thread.group,
                                   tag=f"probe{key}")

    def after_sums(self, fn, *args) -> comm.Pending:
        """Run ``fn(*args)`` on the compression thread once the sums queued there ran."""
        return self._thread.submit(fn, *args)

    def window_sum(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s sum in an exactly summed window (the tensor it was summed in)."""
        return self._src[index]

    def close_window(self) -> dict:
        """The window is over: forget its sums; return the gradients set aside before it
        ({trainable index: (gradient, copy or None)}, rule 2), now the caller's."""
        self._src.clear()
        held, self._aside = self._aside, {}
        return held

    def restore(self, used: list[bool], held: dict) -> None:
        """Rules 1 and 2 for a window whose sum was just written into the buckets: the
        parameters ``used`` marks unused keep what they had, ``held`` is added back."""
        if held or not all(used):
            self._aside = held
            self._restore(used)

    def complete(self, divisor: float, used: list[bool]) -> None:
        if self.delayed is not None:
            return self.delayed.complete(divisor, used)
        if self._probes:  # the whole gradient, compressed vs exact (both still sums)
            probes = [self._probes[k] for k in sorted(self._probes)]
            approx = torch.cat([a[:n].double() for a, _e, n in probes])
            exact = torch.cat([e[:n].double() for _a, e, n in probes])
            self.last_distance = gradient_distance(approx, exact)
            self._probes = {}
        self.windows += 1
        super().complete(divisor, used)

    def reset(self) -> None:
        super().reset()
        if self.delayed is not None:
            self.delayed.reset()

    def flush(self) -> bool:
        """With a delay: put the pending window's sum into ``.grad`` (see ``delayed.py``);
        False when nothing is pending (and always without a delay)."""
        return self.delayed is not None and self.delayed.flush()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
