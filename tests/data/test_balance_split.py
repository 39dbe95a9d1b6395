"""The split of a step's global batch: counts, dealing, micro-batches, and the balancer's
decisions on known timings (no processes: the same arithmetic every rank runs)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.data.balance import ShareBalancer
from gradsync.data.split import bounds, deal, micro_batches, split_counts, step_time
from gradsync.errors import UsageError


@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 6), per=st.integers(1, 12), accum=st.integers(1, 3),
       speeds=st.lists(st.floats(0.05, 1.0), min_size=6, max_size=6),
       fixed=st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6))
def test_counts_sum_to_the_batch_within_bounds_and_minimise_the_slowest(world, per, accum,
                                                                       speeds, fixed):
    gb = world * per * accum
    lo, hi = bounds(gb, world, accum, 0.2, 2.0)
    cost = [1.0 / s for s in speeds[:world]]
    counts = split_counts(gb, cost, lo, hi, fixed[:world])
    assert sum(counts) == gb and all(lo <= c <= hi for c in counts)
    best = step_time(counts, cost, fixed[:world])
    for i in range(world):  # no single move of a sample makes the slowest rank faster
        for j in range(world):
            if i != j and counts[i] > lo and counts[j] < hi:
                moved = list(counts)
                moved[i] -= 1
                moved[j] += 1
                assert step_time(moved, cost, fixed[:world]) >= best - 1e-9


@given(world=st.integers(1, 8), per=st.integers(1, 10))
def test_equal_speeds_give_the_even_split_and_deal_block_r_every_k(world, per):
    gb = world * per
    counts = split_counts(gb, [0.3] * world, 1, gb)
    assert counts == [per] * world
    block = list(range(100, 100 + gb))
    assert deal(block, counts) == [block[r::world] for r in range(world)]


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_deal_partitions_the_block_with_the_given_counts_spread_through_it(counts):
    block = list(range(sum(counts)))
    parts = deal(block, counts)
    assert [len(p) for p in parts] == counts
    assert sorted(i for p in parts for i in p) == block
    for p, c in zip(parts, counts):  # each rank's samples are spread, not one run
        assert p == sorted(p)
        if c > 1:
            assert max(b - a for a, b in zip(p, p[1:])) <= len(block) // c + len(counts)


def test_micro_batches_cut_a_share_in_order_with_sizes_within_one():
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert micro_batches(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]


def test_examples_by_hand():
    assert split_counts(16, [1.0, 2.0], 2, 16) == [11, 5]  # half speed: 2/3 and 1/3
    assert split_counts(16, [1.0, 10.0], 2, 16) == [14, 2]  # pinned at the floor
    assert split_counts(32, [1, 1, 1, 4], 2, 16) == [10, 10, 10, 2]
    # a fixed cost per step shifts samples further from the rank that carries it
    assert split_counts(20, [1.0, 1.0], 1, 20, [0.0, 4.0]) == [12, 8]
    assert bounds(24, 2, 3, 0.2, 2.0) == (3, 24)


def _feed(bal, step, cost, fixed=(0.0, 0.0)):
    busy = [f + c * n for n, c, f in zip(bal.counts, cost, fixed)]
    return bal.observe(step, list(bal.counts), busy)


def test_balancer_waits_for_a_full_window_then_splits_by_speed_and_holds():
    bal = ShareBalancer(2, 24, 1, window=3, every=4, warmup=1)
    changed = [_feed(bal, s, (0.01, 0.02)) for s in range(1, 5)]  # step 1: warm-up
    assert changed == [False, False, False, True]
    assert bal.counts == [16, 8] and bal.changes == [(5, [16, 8])]
    assert bal.saved_s == 0.0  # step 4 itself ran on the even split
    assert not any(_feed(bal, s, (0.01, 0.02)) for s in range(5, 20))  # converged: no flapping
    assert bal.saved_s == pytest.approx(12 * 0.02 - 16 * 0.01)  # even: 0.24 s, now 0.16 s


def test_balancer_learns_a_fixed_cost_from_two_shares():
    bal = ShareBalancer(2, 40, 1, window=2, every=2, warmup=0, min_gain=0.0)
    cost, fixed = (0.01, 0.01), (0.0, 0.1)  # same speed, rank 1 pays 0.1 s a step
    for s in range(1, 12):
        _feed(bal, s, cost, fixed)
    # equal finishing times: n0 * 0.01 == 0.1 + n1 * 0.01, n0 + n1 = 40 -> 25 / 15
    assert bal.counts == [25, 15]
    per, fix = bal.speeds.model(bal.counts)
    assert per == pytest.approx([0.01, 0.01]) and fix == pytest.approx([0.0, 0.1], abs=1e-9)


def test_noise_below_min_gain_keeps_the_even_split():
    bal = ShareBalancer(2, 32, 1, window=2, every=1, warmup=0)
    for s in range(1, 30):
        wobble = 1.0 + 0.04 * (-1) ** s  # +-4%: less than the 10% a change must gain
        bal.observe(s, bal.counts, [0.1 * wobble, 0.1 / wobble])
    assert bal.counts == [16, 16] and bal.changes == []


def test_disabled_balancer_measures_but_never_changes():
    bal = ShareBalancer(2, 24, 1, window=1, every=1, warmup=0, enabled=False)
    for s in range(1, 6):
        _feed(bal, s, (0.01, 0.05))
    assert bal.counts == [12, 12] and bal.even


def test_state_round_trip_and_a_different_world_starts_even():
    bal = ShareBalancer(2, 24, 1, window=2, every=2, warmup=0)
    for s in range(1, 6):
        _feed(bal, s, (0.01, 0.03))
    assert not bal.even
    again = ShareBalancer(2, 24, 1, window=2, every=2, warmup=0)
    again.load_state_dict(bal.state_dict())
    assert again.counts == bal.counts and again.changes == bal.changes
    assert again.speeds.model(again.counts) == bal.speeds.model(bal.counts)
    other = ShareBalancer(3, 24, 1)
    other.load_state_dict(bal.state_dict())
    assert other.counts == [8, 8, 8]


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(UsageError, match="not a multiple"):
        ShareBalancer(2, 25, 1)
    with pytest.raises(UsageError, match="min_share"):
        ShareBalancer(2, 24, 1, min_share=0.0)
    with pytest.raises(UsageError, match="one figure per rank"):
        ShareBalancer(2, 24).observe(1, [12], [0.1])
    with pytest.raises(UsageError, match="block holds"):
        ShareBalancer(2, 24).split(list(range(23)))


def test_train_balances_only_where_the_gradient_is_exact():
    from gradsync.train.config.train_config import TrainConfig

    assert not TrainConfig(out="x").balanced  # the default: off (bit-reproducible runs)
    assert TrainConfig(out="x", balance="auto").balanced
    # elsewhere it would change nothing: refused, naming what it needs (train/config/resolve.py)
    for inexact in ({"sync": "diloco"}, {"compress": "int8"}):
        with pytest.raises(UsageError, match="--balance auto has no effect with .* it needs "
                                             "--sync exact without --compress"):
            TrainConfig(out="x", balance="auto", **inexact)
    with pytest.raises(UsageError, match="--straggler"):
        TrainConfig(out="x", straggler="1:2")
    with pytest.raises(UsageError, match="balance"):
        TrainConfig(out="x", balance="on")


def test_a_change_that_does_not_help_is_undone_and_not_retried_at_once():
    """Rank 1 is slow for a reason its share does not change (a fixed cost the
    proportional model cannot see yet): moving samples away does not help."""
    bal = ShareBalancer(2, 24, 1, window=2, every=2, warmup=0)

    def feed(step):
        n0, _ = bal.counts
        return bal.observe(step, list(bal.counts), [0.1 * n0 / 12, 0.2])

    assert [feed(s) for s in (1, 2)] == [False, True] and bal.counts == [16, 8]
    assert [feed(s) for s in (3, 4)] == [False, True]  # measured no faster: undone
    assert bal.counts == [12, 12] and bal.reverted == 1
    assert not any(feed(s) for s in range(5, 4 + 3 * 2))  # held for 3 x every steps
    assert bal.changes == [(3, [16, 8]), (5, [12, 12])]
