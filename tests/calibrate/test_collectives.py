"""Collective timing on 2 processes: positive medians and a fit of the right shape."""

import pytest

from gradsync.calibrate.collectives import OPS, log_sizes, summarise, time_collectives
from gradsync.errors import UsageError


def test_two_process_timing_and_fit():
    sizes = [4096, 65536, 1 << 20]
    cal = time_collectives(2, sizes=sizes, reps=2)
    assert set(cal.ops) == set(OPS) and cal.world_size == 2
    for op in cal.ops.values():
        assert op.nbytes == tuple(sizes)
        assert len(op.median_s) == 3 and all(t > 0 for t in op.median_s)
        assert op.fit.n_samples == 3
        assert op.fit.alpha_s >= 0 and op.fit.beta_s_per_byte >= 0
        assert op.fit.max_rel_residual >= 0
    assert cal.alpha_s == cal.ops["all_reduce"].fit.alpha_s
    assert cal.beta_s_per_byte == pytest.approx(cal.ops["all_reduce"].fit.beta_s_per_byte)


def test_summary_takes_slowest_rank_then_median():
    # 2 ranks, 1 op, 2 sizes, 3 reps: times follow t = 1 ms + n * 1 ns on the slow rank.
    fast = {"all_reduce": [[0.0005] * 3, [0.0005] * 3]}
    slow = {"all_reduce": [[0.001 + 1000e-9, 9.0, 0.001 + 1000e-9],
                           [0.001 + 3000e-9, 0.001 + 3000e-9, 0.0]]}
    cal = summarise([fast, slow], [1000, 3000], 3)
    op = cal.ops["all_reduce"]
    assert op.median_s == pytest.approx((0.001001, 0.001003))
    assert op.fit.alpha_s == pytest.approx(1e-3, rel=1e-6)
    assert op.fit.beta_s_per_byte == pytest.approx(1e-9, rel=1e-6)


def test_beta_is_link_beta_for_the_ring_model():
    fake = {"all_reduce": [[1.0 + 1.5 * 1000], [1.0 + 1.5 * 2000]]}
    cal = summarise([fake] * 4, [1000, 2000], 1)  # t = 1 + 1.5 n on 4 ranks
    # simulator: alpha + 2(N-1)/N * n * beta, so beta = 1.5 / 1.5 = 1.0
    assert cal.beta_s_per_byte == pytest.approx(1.0)


def test_sizes_and_arguments():
    s = log_sizes(4096, 64 << 20, 9)
    assert s[0] == 4096 and s[-1] == 64 << 20 and s == sorted(set(s))
    assert all(n % 256 == 0 for n in s)
    with pytest.raises(UsageError):
        time_collectives(1)
    with pytest.raises(UsageError):
        time_collectives(2, ops=("all_gather",))


def test_overlap_chain_outlasts_backward_and_is_capped():
    from gradsync.calibrate.overlap import chain_bytes

    n = chain_bytes(0.1, 1e-9)  # 100 ms backward at 1 GB/s: about 300 MB wanted, capped
    assert n == 256 << 20
    small = chain_bytes(0.01, 1e-9)  # 10 ms: about 30 MB, 3x the backward
    assert 0.029 <= small * 1e-9 <= 0.031 and small % 1024 == 0
    assert chain_bytes(0.0, 1e-9) == 1 << 20  # never below 1 MB
