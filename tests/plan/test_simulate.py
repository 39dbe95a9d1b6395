"""Invariants of the step simulator (the bucket-size valley of arXiv 2006.15704, figure 2)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.engine.buckets.plan import mb_to_bytes, plan_buckets
from gradsync.errors import UsageError
from gradsync.plan.profile import (
    PROFILE_VERSION,
    load_profile,
    profile_from_dict,
    profile_to_json,
    synthetic_profile,
)
from gradsync.plan.simulate import allreduce_cost, simulate_step, sweep_bucket_sizes


def total_bytes(p):
    return sum(x.numel * x.itemsize for x in p.params)


def test_buckets_are_the_engines_buckets():
    p = synthetic_profile(layers=6)
    r = simulate_step(p, 3.0, 1.0)
    expected = plan_buckets(p.specs(), mb_to_bytes(3.0), mb_to_bytes(1.0))
    assert [b.nbytes for b in r.buckets] == [b.nbytes for b in expected]


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 12),
    bwd=st.floats(0, 0.01),
    alpha=st.floats(0, 0.005),
    bw=st.floats(1e8, 1e11),
    world=st.integers(1, 16),
    cap=st.floats(0.05, 64),
    accum=st.integers(1, 3),
)
def test_step_invariants(layers, bwd, alpha, bw, world, cap, accum):
    p = synthetic_profile(layers=layers, params_per_layer=100_000, backward_s_per_layer=bwd,
                          alpha_s=alpha, bandwidth=bw, world_size=world, optimizer_s=1e-3)
    r = simulate_step(p, cap, accum_steps=accum)
    assert r.step_s >= r.backward_s
    assert r.exposed_s == pytest.approx(r.step_s - (r.forward_s + r.backward_s + r.optimizer_s))
    assert r.exposed_s >= -1e-12
    assert 0 < r.efficiency <= 1 + 1e-12
    starts = [b.start_s for b in r.buckets]
    assert starts == sorted(starts)
    for b in r.buckets:
        assert b.start_s >= b.ready_s - 1e-15


def test_one_giant_bucket_has_no_overlap():
    p = synthetic_profile(layers=10, optimizer_s=2e-3)
    r = simulate_step(p, bucket_cap_mb=4096, first_bucket_mb=4096)
    assert len(r.buckets) == 1
    full = allreduce_cost(total_bytes(p), p.world_size, p.alpha_s, p.beta_s_per_byte)
    assert r.exposed_s == pytest.approx(full)
    assert r.buckets[0].start_s == pytest.approx(r.backward_end_s)


def test_tiny_buckets_are_latency_dominated():
    p = synthetic_profile(layers=10, alpha_s=5e-3)
    tiny = simulate_step(p, bucket_cap_mb=1e-6)
    assert len(tiny.buckets) == len(p.params)
    latency = len(p.params) * p.alpha_s
    bandwidth = allreduce_cost(total_bytes(p), p.world_size, 0, p.beta_s_per_byte)
    assert tiny.comm_s == pytest.approx(latency + bandwidth)
    assert latency > bandwidth
    assert tiny.step_s > simulate_step(p, bucket_cap_mb=8).step_s


def test_zero_cost_comm_gives_efficiency_one():
    p = synthetic_profile(alpha_s=0.0).with_(beta_s_per_byte=0.0)
    for cap in (0.5, 25, 2048):
        r = simulate_step(p, cap)
        assert r.efficiency == pytest.approx(1.0)
        assert r.exposed_s == pytest.approx(0.0)


def test_single_worker_sends_nothing():
    r = simulate_step(synthetic_profile(world_size=1))
    assert r.comm_s == 0 and r.efficiency == 1


def test_accumulation_communicates_once():
    p = synthetic_profile(layers=8)
    one, four = simulate_step(p, accum_steps=1), simulate_step(p, accum_steps=4)
    assert four.comm_s == pytest.approx(one.comm_s)
    assert four.exposed_s == pytest.approx(one.exposed_s)
    assert four.compute_s == pytest.approx(4 * (p.forward_s + p.backward_s) + p.optimizer_s)
    assert four.efficiency > one.efficiency


def test_sweep_has_a_valley_inside_the_range():
    sw = sweep_bucket_sizes(synthetic_profile(layers=24))
    assert sw.sizes_mb[0] == 1.0 and sw.sizes_mb[-1] == 2048.0
    assert 25.0 in sw.sizes_mb
    assert sw.sizes_mb[0] < sw.optimum_mb < sw.sizes_mb[-1]
    assert sw.optimum_s < sw.step_s[0] and sw.optimum_s < sw.step_s[-1]
    assert sw.optimum_s <= sw.default_s


def test_profile_roundtrip_and_version(tmp_path):
    p = synthetic_profile(layers=3)
    path = tmp_path / "p.json"
    path.write_text(profile_to_json(p))
    assert load_profile(str(path)) == p
    d = json.loads(profile_to_json(p))
    d["version"] = PROFILE_VERSION + 1
    with pytest.raises(UsageError, match="version"):
        profile_from_dict(d)
    del d["version"]
    with pytest.raises(UsageError, match="version"):
        profile_from_dict(d)
    with pytest.raises(UsageError, match="malformed"):
        profile_from_dict({"version": PROFILE_VERSION, "params": []})


def test_a_profile_that_is_not_utf8_is_one_line(tmp_path):
    """Issue 34: a junk --profile was a UnicodeDecodeError traceback at 4ab900c."""
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(UsageError, match="is not JSON: byte 0xff at offset 0 is not UTF-8"):
        load_profile(str(path))


def test_bad_simulation_input():
    p = synthetic_profile(layers=2)
    with pytest.raises(UsageError):
        simulate_step(p, bucket_cap_mb=0)
    with pytest.raises(UsageError):
        simulate_step(p, accum_steps=0)
    with pytest.raises(UsageError):
        synthetic_profile(layers=0)
    with pytest.raises(UsageError):
        p.with_(world_size=0)
