"""DataParallel with compressed buckets: a bucket reduction that sends through a compressor.

``gs.DataParallel(module, reduction=CompressedBuckets(parse_compression("int8")))``.
DataParallel keeps its hooks, launch order, item header and ``num_items``
division (``engine/reduction.py``); only how a ready bucket travels changes:

* the first ``exact_windows`` synchronised windows (default 1) are all-reduced
  exactly: DataParallel rebuilds its buckets once, after its first synchronised
  backward, and a compressor's state (residuals, PowerSGD's Q) belongs to one
  layout; the same rule as torch's ``start_powerSGD_iter`` >= 2;
* afterwards each bucket is handed to the compressor on a communication thread
  over a process group of its own (``thread.py``), so the encoding overlaps the
  rest of backward, and the item header travels separately, exactly.

The gradient DataParallel hands the optimizer is then the compressed sum divided
by the exact global item count.
"""

from __future__ import annotations

import torch

from ..reduction import AllReduceBuckets
from .base import Compressor
from .thread import CompressionThread


class CompressedBuckets(AllReduceBuckets):
    """Bucket reduction through ``compressor`` (see the module docstring).

    reduce_dtype: as for :class:`AllReduceBuckets` (compress fp32 sums of a bf16 model).
    comm_group: the compression thread's group (default: a new one with the same ranks).
    """

    exact_sum = False  # the item header travels separately, exactly

    def __init__(self, compressor: Compressor, exact_windows: int = 1,
                 reduce_dtype: torch.dtype | None = None, comm_group=None):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"CompressedBuckets needs a Compressor, got {type(compressor).__name__}"
                            " (parse_compression('none') is None: use no reduction at all)")
        if isinstance(exact_windows, bool) or not isinstance(exact_windows, int) \
                or exact_windows < 0:
            raise ValueError(f"exact_windows must be an int >= 0, got {exact_windows!r}")
        super().__init__(reduce_dtype)
        self.compressor = compressor
        self.exact_windows = exact_windows
        self.windows = 0  # synchronised windows completed
        self._comm_group = comm_group
        self._thread: CompressionThread | None = None

    def attach(self, dp) -> None:
        super().attach(dp)
        if self._thread is None:
            self._thread = CompressionThread(self.compressor, dp.group, self._comm_group)

    def communicate(self, bucket, src):
        if self.windows < self.exact_windows:
            return super().communicate(bucket, src)
        return self._thread.launch(bucket.spec.index, src, [p.shape for p in bucket.params])

    def complete(self, divisor: float, used: list[bool]) -> None:
        self.windows += 1
        super().complete(divisor, used)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
