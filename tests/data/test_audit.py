"""summarize_shards on hand-made shards, and the rendered table."""

from __future__ import annotations

import pytest
from rich.console import Console

from gradsync.data import SamplerAudit, render_audit, summarize_shards


def test_partition():
    a = summarize_shards([[0, 2], [1, 3]], 4)
    assert a.is_partition and a.n_duplicate_draws == 0
    assert a.per_rank_counts == [2, 2] and a.total_consumed == 4 and a.world_size == 2


def test_overlap_and_missing():
    # no distributed sampler: every worker drawing from the full dataset
    a = summarize_shards([[0, 1, 1], [1, 4], []], 6)
    assert a.duplicated == {1: [0, 0, 1]}
    assert a.n_duplicate_draws == 2
    assert a.missing == [2, 3, 5]
    assert a.per_rank_counts == [3, 2, 0] and a.total_consumed == 5
    assert not a.is_partition


def test_missing_only():
    a = summarize_shards([[0], [2]], 3)
    assert not a.duplicated and a.missing == [1] and not a.is_partition


def test_out_of_range_index_is_an_error():
    with pytest.raises(ValueError, match="rank 1 consumed index 7"):
        summarize_shards([[0], [7]], 3)


def test_render_mentions_the_verdict():
    console = Console(record=True, width=100)
    console.print(render_audit(summarize_shards([[0, 1], [1]], 3), "epoch 0"))
    text = console.export_text()
    assert "epoch 0" in text and "not a partition" in text and "missing" in text
    console.print(render_audit(SamplerAudit(2, 1, [2], total_consumed=2)))
    assert "partition" in console.export_text()


@pytest.fixture
def world_of_one():
    """A real gloo group of size 1 in this process, so the collective path runs."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_audit_collectives_in_a_world_of_one(world_of_one):
    from gradsync.data import DistributedSampler, audit_indices, audit_sampler

    sampler = DistributedSampler(range(9), mode="pad")  # world size/rank from the group
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert audit_sampler(sampler, epoch=2).is_partition
    a = audit_indices([3, 3, 0], 4)
    assert a.duplicated == {3: [0, 0]} and a.missing == [1, 2]
