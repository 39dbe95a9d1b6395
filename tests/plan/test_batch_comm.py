"""The batch recipe gbs = mbs x grad_acc x dp and parameter server vs ring all-reduce."""

import pytest

from gradsync.errors import UsageError
from gradsync.plan.batch import nearest_power_of_two, plan_batch
from gradsync.plan.comm import (
    hierarchical_allreduce_time,
    plan_comm,
    reduce_scatter_time,
    ring_allreduce_time,
    tree_allreduce_time,
)
from gradsync.plan.units import parse_rate


def test_batch_table_4m_tokens_seq_4096():
    plan = plan_batch(4_000_000, 4096, 2, [128, 512, 1024])
    assert int(plan.samples_exact) == 976
    assert plan.samples == 1024
    rows = {r.workers: r for r in plan.rows}
    assert rows[128].grad_accum == 4 and not rows[128].below_one
    assert rows[512].grad_accum == 1 and not rows[512].below_one
    assert rows[1024].grad_accum < 1 and rows[1024].below_one
    assert rows[1024].grad_accum_steps == 1


def test_batch_without_rounding():
    plan = plan_batch(4_000_000, 4096, 2, [8], round_pow2=False)
    assert plan.samples == 976
    assert plan.rows[0].grad_accum_steps == 61 and plan.rows[0].exact


def test_power_of_two_rounding():
    assert [nearest_power_of_two(x) for x in (976, 700, 1, 1.4, 3000)] == [1024, 512, 1, 1, 4096]


@pytest.mark.parametrize("kw", [dict(global_tokens=0), dict(seq_len=0), dict(micro_batch=0),
                                dict(workers=[0]), dict(workers=[])])
def test_batch_bad_input(kw):
    args = dict(global_tokens=4e6, seq_len=4096, micro_batch=2, workers=[8]) | kw
    with pytest.raises(UsageError):
        plan_batch(**args)


def test_ps_vs_ring_2b_fp16_gradients_at_25gbps():
    plan = plan_comm(int(2e9), 2, [8, 64, 512], 25e9)
    ps = [r.ps_ingress_s for r in plan.rows]
    ring = [r.ring_s for r in plan.rows]
    assert ps == pytest.approx([1.28, 10.24, 81.92])
    assert ring == pytest.approx([0.28, 0.315, 0.319375])
    assert [round(t, 2) for t in ring] == [0.28, 0.32, 0.32]


def test_volumes_zero3_is_one_and_a_half_times_dp():
    row = plan_comm(1000, 2, [4], 1e9).rows[0]
    assert row.zero3_volume_bytes == pytest.approx(1.5 * row.dp_volume_bytes)
    assert row.dp_volume_bytes == pytest.approx(2 * 3 / 4 * 2000)


def test_collective_identities():
    S, bw, a = 1e8, 1e10, 1e-5
    for n in (2, 8, 64):
        ring = ring_allreduce_time(S, n, bw, a)
        assert ring == pytest.approx(2 * reduce_scatter_time(S, n, bw, a))
        assert tree_allreduce_time(S, n, bw, a) <= ring_allreduce_time(S, n, bw, a)
    assert ring_allreduce_time(S, 1, bw, a) == 0
    # hierarchical with one worker per node is a ring over everyone
    assert hierarchical_allreduce_time(S, 8, 1, 1e11, bw, a) == pytest.approx(
        ring_allreduce_time(S, 8, bw, a))
    # a fast intra-node fabric makes hierarchical cheaper than a flat ring on slow links
    assert hierarchical_allreduce_time(S, 64, 8, 3e11, bw, a) < ring_allreduce_time(S, 64, bw, a)


def test_comm_bad_input():
    with pytest.raises(UsageError):
        plan_comm(0, 2, [8], 1e9)
    with pytest.raises(UsageError):
        plan_comm(10, 2, [0], 1e9)
    with pytest.raises(UsageError):
        hierarchical_allreduce_time(1e6, 12, 8, 1e9, 1e9)


def test_hierarchical_wins_when_latency_dominates():
    small, a = 1e4, 5e-5  # 10 KB message, 50 us per hop: latency-bound
    assert hierarchical_allreduce_time(small, 512, 8, 3e11, 25e9, a) < ring_allreduce_time(
        small, 512, 25e9, a) / 4


@pytest.mark.parametrize("text,value", [("25GB/s", 25e9), ("25", 25e9), ("25GB", 25e9),
                                         ("100Gbit/s", 12.5e9), ("100Gbps", 12.5e9),
                                         ("750MB/s", 750e6), ("1GiB/s", 2**30)])
def test_parse_rate(text, value):
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["100Gb/s", "25XB/s", "0GB/s", "fast"])
def test_parse_rate_rejects(bad):
    with pytest.raises(UsageError):
        parse_rate(bad)
