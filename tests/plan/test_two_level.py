"""The two-level all-reduce model: textbook closed forms fall out of the round rule."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradsync.errors import UsageError
from gradsync.plan.comm import ring_allreduce_time
from gradsync.plan.two_level import (
    ALGORITHMS,
    Link,
    TwoLevelTopology,
    compare,
    plan_two_level,
    predict,
    schedule,
)

INTRA, INTER = Link(2e-5, 1e-9), Link(3e-4, 8e-8)  # loopback-ish and 100 Mbit/s-ish
S = 32e6


def topo(hosts, g, intra=INTRA, inter=INTER):
    return TwoLevelTopology(hosts, g, intra, inter)


def test_one_host_ring_is_the_textbook_ring():
    t = predict("ring", S, topo(1, 4)).seconds
    assert t == pytest.approx(ring_allreduce_time(S, 4, 1 / INTRA.beta_s_per_byte,
                                                  INTRA.alpha_s))


@pytest.mark.parametrize("hosts, g", [(2, 1), (2, 2), (3, 2), (4, 1), (2, 4)])
def test_flat_ring_and_hierarchical_closed_forms(hosts, g):
    n = hosts * g
    ring = predict("ring", S, topo(hosts, g))
    assert ring.seconds == pytest.approx(2 * (n - 1) * INTER.time(S / n))
    assert ring.max_host_out_bytes == pytest.approx(2 * (n - 1) / n * S)
    hier = predict("hierarchical", S, topo(hosts, g))
    expected = 2 * (g - 1) * INTRA.time(S / g) + 2 * (hosts - 1) * INTER.time(S / hosts)
    assert hier.seconds == pytest.approx(expected)
    assert hier.max_host_out_bytes == pytest.approx(2 * (hosts - 1) / hosts * S)
    assert hier.inter_rounds == 2 * (hosts - 1) and ring.inter_rounds == 2 * (n - 1)


def test_server_root_link_saturates_linearly_with_workers():
    times = [predict("server", S, topo(h, 1)).seconds for h in (2, 3, 4)]
    for h, t in zip((2, 3, 4), times):
        assert t == pytest.approx(2 * INTER.time((h - 1) * S))
    rings = [predict("ring", S, topo(h, 1)).seconds for h in (2, 3, 4)]
    assert rings[-1] < 1.6 * rings[0] and times[-1] == pytest.approx(3 * times[0], rel=0.01)


def test_tree_rounds_and_whole_tensor_messages():
    for n in (2, 3, 4, 5, 8):
        rounds = schedule("tree", 100.0, n, 1)
        assert len(rounds) == 2 * math.ceil(math.log2(n))
        assert all(b == 100.0 for rnd in rounds for _, _, b in rnd)
        receivers = {d for rnd in rounds[len(rounds) // 2:] for _, d, _ in rnd}
        assert receivers == set(range(1, n))  # the broadcast reaches everyone once


def test_every_rank_sends_the_ring_volume():
    n = 6
    sent = [0.0] * n
    for rnd in schedule("ring", 600.0, 3, 2):
        for s, _, b in rnd:
            sent[s] += b
    assert sent == [pytest.approx(2 * (n - 1) / n * 600.0)] * n


@given(hosts=st.integers(2, 8), g=st.integers(1, 8), nbytes=st.floats(1, 1e9),
       alpha=st.floats(0, 1e-2), beta=st.floats(1e-10, 1e-6))
def test_hierarchical_never_loses_to_the_flat_ring_when_the_host_is_free(hosts, g, nbytes,
                                                                         alpha, beta):
    t = topo(hosts, g, Link(0.0, 0.0), Link(alpha, beta))
    assert predict("hierarchical", nbytes, t).seconds <= predict("ring", nbytes, t).seconds * (
        1 + 1e-9)


def test_compare_orders_fastest_first_and_names_every_algorithm():
    costs = compare(S, topo(2, 2))
    assert {c.algorithm for c in costs} == set(ALGORITHMS)
    assert [c.seconds for c in costs] == sorted(c.seconds for c in costs)
    assert costs[0].algorithm == "hierarchical" and costs[-1].algorithm == "server"


def test_bad_input_is_one_line():
    with pytest.raises(UsageError, match="unknown algorithm"):
        predict("butterfly", S, topo(2, 2))
    with pytest.raises(UsageError, match="inter-host algorithm"):
        predict("hierarchical", S, topo(2, 2), inter="nope")
    with pytest.raises(UsageError, match="alpha_s"):
        Link(-1.0, 0.0)
    with pytest.raises(UsageError, match="hosts"):
        TwoLevelTopology(0, 2, INTRA, INTER)
    with pytest.raises(UsageError, match=">= 0 bytes"):
        schedule("ring", -1, 2, 2)


def test_plan_prices_every_algorithm_at_every_worker_count():
    plan = plan_two_level(S, [4, 8, 4096], 4, INTRA, INTER)
    assert [(r.workers, r.hosts) for r in plan.rows] == [(4, 1), (8, 2), (4096, 1024)]
    for r in plan.rows:
        t = topo(r.hosts, 4)
        assert [c.algorithm for c in r.costs] == list(ALGORITHMS)
        assert [c.seconds for c in r.costs] == [predict(a, S, t).seconds for a in ALGORITHMS]
        assert r.fastest == min(r.costs, key=lambda c: c.seconds)
    # thousands of ranks: repeated rounds are priced once, and still the closed forms
    big = plan.rows[-1].costs
    n, h = 4096, 1024
    assert big[0].seconds == pytest.approx(2 * (n - 1) * INTER.time(S / n))
    assert big[3].seconds == pytest.approx(2 * 3 * INTRA.time(S / 4)
                                           + 2 * (h - 1) * INTER.time(S / h))
    with pytest.raises(UsageError, match=r"\[6\] do not fill hosts of 4"):
        plan_two_level(S, [4, 6], 4, INTRA, INTER)
    with pytest.raises(UsageError, match="worker counts"):
        plan_two_level(S, [0], 4, INTRA, INTER)
