"""PartedStepSampler (``--data-parts P``): each block of ranks reads its own contiguous part.

Pure (no processes): ranks are simulated, as in tests/train/test_step_sampler.py.
P = 1 is today's StepSampler bit for bit; every index of part p is read by block p's
ranks only and exactly once per part-epoch; the samples of each step depend on P,
not on the number of ranks K, also across a checkpoint onto another K; what cannot
be kept exact is refused in one line.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradsync as gs
from gradsync.data.parted_sampler import (
    PART_SEED_STRIDE,
    PartedStepSampler,
    make_step_sampler,
    part_bounds,
)
from gradsync.data.sampler import StepSampler


def _world_batch(data):
    """(P, K, B): P divides K, K divides B."""
    parts = data.draw(st.integers(1, 4), label="parts")
    world = parts * data.draw(st.integers(1, 3), label="ranks per part")
    batch = world * data.draw(st.integers(1, 3), label="samples per rank")
    return parts, world, batch


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), world=st.sampled_from([1, 2, 3, 4]),
       per_rank=st.integers(1, 3), steps=st.integers(1, 20), seed=st.integers(-3, 5))
def test_one_part_is_todays_step_sampler_bit_for_bit(n, world, per_rank, steps, seed):
    gb = world * per_rank
    if gb > n:
        return
    old, new = StepSampler(n, gb, seed=seed), PartedStepSampler(n, gb, 1, world, seed=seed)
    for _ in range(steps):
        assert new.next_block() == old.next_block()
    assert (new.state_dict()["epochs"], new.state_dict()["positions"]) == \
        ([old.epoch], [old.position])
    assert type(make_step_sampler(n, gb, 1, world, seed)) is StepSampler  # P=1: today's class


@settings(max_examples=60, deadline=None)
@given(data=st.data(), extra=st.integers(0, 30), steps=st.integers(1, 25), seed=st.integers(0, 5))
def test_each_part_is_read_by_its_block_only_and_once_per_part_epoch(data, extra, steps, seed):
    parts, world, gb = _world_batch(data)
    n = gb + extra
    sampler = PartedStepSampler(n, gb, parts, world, seed=seed)
    bounds, per_part = part_bounds(n, parts), world // parts
    streams: list[list[int]] = [[] for _ in range(parts)]
    for _ in range(steps):
        block = sampler.next_block()
        for r in range(world):
            share = sampler.share(block, r, world)
            lo, hi = bounds[r // per_part]
            assert len(share) == gb // world and all(lo <= i < hi for i in share)
        for p in range(parts):  # block p's shares, in rank order, interleaved back
            shares = [sampler.share(block, p * per_part + j, world) for j in range(per_part)]
            streams[p] += [shares[i % per_part][i // per_part] for i in range(gb // parts)]
    for p, (lo, hi) in enumerate(bounds):
        size = hi - lo
        for e in range(len(streams[p]) // size):
            assert sorted(streams[p][e * size:(e + 1) * size]) == list(range(lo, hi))
        # the seeding documented: part p's epoch e is randperm seeded seed + e + p * 2**20
        first = torch.randperm(size, generator=torch.Generator().manual_seed(
            seed + p * PART_SEED_STRIDE)).tolist()
        assert streams[p][:min(size, len(streams[p]))] == [lo + i for i in first][:len(streams[p])]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(12, 40), segments=st.lists(st.tuples(st.sampled_from([2, 4, 6]),
                                                          st.integers(1, 6)),
                                                min_size=1, max_size=4),
       seed=st.integers(0, 3))
def test_steps_take_the_same_samples_whatever_the_ranks_also_across_checkpoints(n, segments,
                                                                              seed):
    gb, parts = 12, 2
    reference = PartedStepSampler(n, gb, parts, parts, seed=seed)  # K = P
    state = None
    for world, count in segments:
        sampler = PartedStepSampler(n, gb, parts, world, seed=seed)
        if state is not None:
            sampler.load_state_dict(state)
        for _ in range(count):
            assert sorted(sampler.next_block()) == sorted(reference.next_block())
        state = sampler.state_dict()


def test_parts_of_equal_length_are_shuffled_differently():
    sampler = PartedStepSampler(40, 40, 2, 2, seed=0)  # one step: both parts' first epoch
    first, second = sampler.part_blocks()
    assert first != [i - 20 for i in second]


def test_two_and_four_ranks_give_each_step_the_same_set():
    two, four = (PartedStepSampler(42, 12, 2, k, seed=0) for k in (2, 4))
    for _ in range(10):
        assert set(two.next_block()) == set(four.next_block())


@pytest.mark.parametrize("args,message", [
    ((42, 12, 3, 4), r"--data-parts 3 must divide the number of workers \(4\) and "
                     r"--global-batch \(12\)"),
    ((42, 10, 2, 4), r"--global-batch 10 is not a multiple of the 4 workers"),
    ((42, 12, 0, 4), r"--data-parts must be an integer >= 1, got 0"),
    ((9, 12, 2, 2), r"part 0 holds 4 of the 9 training samples, fewer than its 6 a step"),
])
def test_bad_parts_are_refused_in_one_line(args, message):
    with pytest.raises(gs.UsageError, match=message) as err:
        PartedStepSampler(*args)
    assert "\n" not in str(err.value)


def test_a_checkpoint_of_other_parts_is_refused():
    sampler = PartedStepSampler(42, 12, 2, 2)
    with pytest.raises(gs.UsageError, match=r"came in 1 part\(s\), --data-parts is 2"):
        sampler.load_state_dict(StepSampler(42, 12).state_dict())
    with pytest.raises(gs.UsageError, match=r"came in 3 part\(s\)"):
        sampler.load_state_dict(PartedStepSampler(42, 12, 3, 3).state_dict())


@pytest.mark.parametrize("kw,message", [
    ({"data_parts": 3}, r"--data-parts 3 must divide --global-batch \(16\)"),
    ({"data_parts": 2, "balance": "auto"}, r"--balance auto does not combine with --data-parts 2"),
    ({"data_parts": 2, "ft_groups": 2}, r"--ft-groups 2 does not combine with --data-parts 2"),
    ({"data_parts": -1}, r"--data-parts must be an integer >= 1"),
])
def test_train_config_refuses_what_parts_cannot_keep_apart(tmp_path, kw, message):
    with pytest.raises(gs.UsageError, match=message) as err:
        gs.TrainConfig(out=str(tmp_path / "run"), global_batch=16, **kw)
    assert "\n" not in str(err.value)
