"""ItemWindow on its own: exact counts through a float32 sum, one count per pass."""

import pytest
import torch

from gradsync.engine.sync.item_window import HEADER_SLOTS, MAX_ITEMS, ItemWindow
from gradsync.errors import UsageError


def _summed(*windows, dtype=torch.float32):
    total = torch.zeros(HEADER_SLOTS, dtype=dtype)
    for w in windows:
        slots = torch.zeros(HEADER_SLOTS, dtype=dtype)
        w.write(slots)
        total += slots
    return total


def test_item_counts_survive_a_float32_sum_exactly():
    a, b = ItemWindow(2, 0), ItemWindow(2, 1)
    big = 2**30 + 12345  # far beyond float32's 2**24 exact-integer range
    with a.item_pass(big):
        a.pass_joined()  # the backward's own hook: already counted
    with b.item_pass(7):
        b.pass_joined()
    assert a.close(_summed(a, b)) == big + 7


def test_plain_passes_count_once_per_pass_and_every_window():
    w = ItemWindow(4, 0)
    for _window in range(3):
        for _pass in range(2):
            w.pass_joined()
            w.pass_joined()  # several hooks announce the same pass
            w.pass_ended()
        assert w.plain_passes == 2
        assert w.close(_summed(w)) == 4.0  # plain mean of means: divide by the world size


def test_mixed_window_and_empty_batch_raise_and_reset():
    w = ItemWindow(2, 1)
    with w.item_pass(3):
        pass
    w.pass_joined()
    with pytest.raises(UsageError, match="mixed"):
        w.close(_summed(w))
    assert (w.items, w.item_passes, w.plain_passes) == (0, 0, 0)
    with w.item_pass(0):
        pass
    with pytest.raises(UsageError, match="no items"):
        w.close(_summed(w))


def test_too_many_items_is_named():
    w = ItemWindow(2, 0)
    with w.item_pass(MAX_ITEMS // 2):
        pass
    with pytest.raises(UsageError, match="rank 0"):
        w.write(torch.zeros(HEADER_SLOTS))
