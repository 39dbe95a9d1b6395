"""Overlap penalties: zero reproduces the plain simulator; penalties only slow the step."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.errors import UsageError
from gradsync.plan.profile import profile_from_dict, profile_to_json, synthetic_profile
from gradsync.plan.simulate import simulate_step


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 12), bucket=st.sampled_from([0.5, 2, 8, 64]),
       bw=st.sampled_from([1e8, 1e9, 1e10]))
def test_tiny_penalty_matches_plain_schedule(layers, bucket, bw):
    prof = synthetic_profile(layers=layers, params_per_layer=300_000, bandwidth=bw)
    plain = simulate_step(prof, bucket)
    near = simulate_step(prof.with_(overlap_compute_penalty=1e-12), bucket)
    assert near.step_s == pytest.approx(plain.step_s, rel=1e-9, abs=1e-12)
    assert [b.start_s for b in near.buckets] == pytest.approx([b.start_s for b in plain.buckets])
    assert [g.end_s for g in near.grads] == pytest.approx([g.end_s for g in plain.grads])


def test_penalties_slow_small_buckets_and_spare_one_big_bucket():
    prof = synthetic_profile(layers=8, bandwidth=2e8)
    plain = [simulate_step(prof, b).step_s for b in (1, 4096)]
    hurt = prof.with_(overlap_compute_penalty=0.6, overlap_comm_penalty=0.3)
    slow = [simulate_step(hurt, b).step_s for b in (1, 4096)]
    assert slow[0] > plain[0]  # overlap costs compute
    # One bucket launched after backward ends (plus the small first bucket) barely overlaps.
    assert slow[1] >= plain[1]
    full = prof.with_(overlap_compute_penalty=0.999, overlap_comm_penalty=0.0)
    serial = prof.forward_s + prof.backward_s + simulate_step(prof, 1).comm_s
    assert simulate_step(full, 1).step_s == pytest.approx(serial, rel=0.01)


def test_json_round_trip_and_old_files_still_load():
    prof = synthetic_profile(layers=2).with_(overlap_compute_penalty=0.4)
    assert profile_from_dict(__import__("json").loads(profile_to_json(prof))) == prof
    d = dataclasses.asdict(synthetic_profile(layers=2))
    del d["overlap_compute_penalty"], d["overlap_comm_penalty"]
    d["version"] = 1
    assert profile_from_dict(d).overlap_compute_penalty == 0.0
    with pytest.raises(UsageError, match="overlap_compute_penalty"):
        prof.with_(overlap_compute_penalty=1.0)
