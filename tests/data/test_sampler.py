"""DistributedSampler: partition properties per mode, determinism, resume, errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.data import DistributedSampler, summarize_shards
from gradsync.errors import UsageError

FAST = settings(max_examples=60, deadline=None)

n_st = st.integers(1, 300)
k_st = st.integers(1, 8)
seed_st = st.integers(0, 2**31 - 1)
epoch_st = st.integers(0, 50)


def shards(n, k, mode, seed=0, epoch=0, shuffle=True):
    out = []
    for r in range(k):
        s = DistributedSampler(range(n), k, r, shuffle=shuffle, seed=seed, mode=mode)
        s.set_epoch(epoch)
        got = list(s)
        assert len(got) == len(s) == s.num_samples_on(r)
        out.append(got)
    return out


@FAST
@given(n_st, k_st, seed_st, epoch_st, st.booleans())
def test_exact_is_a_partition(n, k, seed, epoch, shuffle):
    per_rank = shards(n, k, "exact", seed, epoch, shuffle)
    audit = summarize_shards(per_rank, n)
    assert audit.is_partition
    sizes = [len(s) for s in per_rank]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


@FAST
@given(n_st, k_st, seed_st, epoch_st)
def test_drop_is_disjoint_equal_and_misses_fewer_than_k(n, k, seed, epoch):
    if n < k:
        with pytest.raises(UsageError, match=f"{k} replicas and only {n} samples"):
            DistributedSampler(range(n), k, 0, mode="drop")
        return
    per_rank = shards(n, k, "drop", seed, epoch)
    audit = summarize_shards(per_rank, n)
    assert not audit.duplicated
    assert len({len(s) for s in per_rank}) == 1
    assert len(audit.missing) == n % k < k


@FAST
@given(n_st, k_st, seed_st, epoch_st)
def test_pad_is_equal_covers_all_and_repeats_only_padding(n, k, seed, epoch):
    per_rank = shards(n, k, "pad", seed, epoch)
    audit = summarize_shards(per_rank, n)
    assert len({len(s) for s in per_rank}) == 1
    assert not audit.missing
    padded = math.ceil(n / k) * k - n
    assert audit.n_duplicate_draws == padded == audit.total_consumed - n


@FAST
@given(n_st, k_st, st.sampled_from(["pad", "drop", "exact"]), seed_st, epoch_st)
def test_deterministic_per_seed_and_epoch(n, k, mode, seed, epoch):
    if mode == "drop" and n < k:
        return
    assert shards(n, k, mode, seed, epoch) == shards(n, k, mode, seed, epoch)


@FAST
@given(st.integers(10, 300), seed_st, epoch_st)
def test_new_epoch_reshuffles(n, seed, epoch):
    s = DistributedSampler(range(n), 1, 0, seed=seed)
    assert s.global_order(epoch) != s.global_order(epoch + 1)
    assert sorted(s.global_order(epoch)) == list(range(n))


def test_no_shuffle_is_interleaved_arange():
    assert shards(7, 3, "exact", shuffle=False) == [[0, 3, 6], [1, 4], [2, 5]]
    assert shards(7, 3, "pad", shuffle=False) == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    assert shards(7, 3, "drop", shuffle=False) == [[0, 3], [1, 4], [2, 5]]
    assert shards(2, 5, "pad", shuffle=False) == [[0], [1], [0], [1], [0]]


@FAST
@given(n_st, k_st, st.sampled_from(["pad", "drop", "exact"]), seed_st, epoch_st, st.data())
def test_resume_yields_exactly_the_rest(n, k, mode, seed, epoch, data):
    if mode == "drop" and n < k:
        return
    rank = data.draw(st.integers(0, k - 1))
    a = DistributedSampler(range(n), k, rank, seed=seed, mode=mode)
    a.set_epoch(epoch)
    full = list(a)
    j = data.draw(st.integers(0, len(full)))
    it = iter(a)
    head = [next(it) for _ in range(j)]
    sd = a.state_dict()
    assert sd["yielded"] == j and sd["epoch"] == epoch

    b = DistributedSampler(range(n), k, rank, seed=seed, mode=mode)
    b.load_state_dict(sd)
    b.set_epoch(epoch)  # the usual loop calls set_epoch again: must keep the offset
    assert head + list(b) == full
    assert list(b) == full  # the offset applied to one pass only


@FAST
@given(n_st, k_st, seed_st, st.data())
def test_consumed_overrides_prefetched_count(n, k, seed, data):
    rank = data.draw(st.integers(0, k - 1))
    a = DistributedSampler(range(n), k, rank, seed=seed, mode="exact")
    full = list(a)  # a prefetching DataLoader may have drawn everything
    j = data.draw(st.integers(0, len(full)))
    sd = a.state_dict(consumed=j)
    assert sd["yielded"] == j
    b = DistributedSampler(range(n), k, rank, seed=seed, mode="exact")
    b.load_state_dict(sd)
    assert list(b) == full[j:]


def test_state_dict_fields():
    s = DistributedSampler(range(10), 2, 1, seed=3, mode="exact")
    s.set_epoch(4)
    assert s.state_dict() == {
        "epoch": 4,
        "yielded": 0,
        "seed": 3,
        "mode": "exact",
        "shuffle": True,
        "num_replicas": 2,
        "rank": 1,
        "dataset_len": 10,
    }


def test_set_epoch_discards_a_pending_resume():
    a = DistributedSampler(range(20), 2, 0)
    it = iter(a)
    next(it)
    b = DistributedSampler(range(20), 2, 0)
    b.load_state_dict(a.state_dict())
    b.set_epoch(1)
    assert len(list(b)) == len(b)


@pytest.mark.parametrize(
    "field,value",
    [("seed", 1), ("mode", "exact"), ("shuffle", False), ("num_replicas", 3), ("dataset_len", 11)],
)
def test_load_state_dict_mismatch_names_field_and_values(field, value):
    sd = DistributedSampler(range(10), 2, 0).state_dict()
    theirs = sd[field]
    sd[field] = value
    s = DistributedSampler(range(10), 2, 0)
    s_value = getattr(s, field)
    with pytest.raises(UsageError, match=field) as exc:
        s.load_state_dict(sd)
    assert repr(value) in str(exc.value) and repr(s_value) in str(exc.value)
    assert s_value == theirs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_replicas": 2, "rank": 0, "mode": "wrap"}, "mode must be one of"),
        ({"num_replicas": 2, "rank": 2}, r"rank must be in \[0, 2\)"),
        ({"num_replicas": 2, "rank": -1}, r"rank must be in \[0, 2\)"),
        ({"num_replicas": 0, "rank": 0}, "num_replicas must be >= 1"),
        ({"num_replicas": 20, "rank": 0, "mode": "drop"}, "20 replicas and only 10 samples"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(range(10), **kwargs)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="empty dataset"):
        DistributedSampler([], 2, 0)


def test_without_process_group_needs_explicit_world():
    with pytest.raises(ValueError, match="num_replicas and rank"):
        DistributedSampler(range(10))
    with pytest.raises(ValueError, match="num_replicas and rank"):
        DistributedSampler(range(10), num_replicas=2)


def test_works_as_dataloader_sampler():
    from torch.utils.data import DataLoader

    ds = list(range(10))
    s = DistributedSampler(ds, 3, 2, mode="exact", shuffle=False)
    batches = [b.tolist() for b in DataLoader(ds, batch_size=2, sampler=s)]
    assert batches == [[2, 5], [8]]
