"""The sampler audit on real processes: what every rank consumed, gathered and checked."""

import gradsync as gs
from gradsync.checks.sampler_check import run_sampler_check


def test_audit_across_three_ranks_matches_each_mode():
    check = run_sampler_check(dataset_len=101, workers=3)
    assert check.passed
    assert check.audits["exact"].is_partition
    assert check.audits["exact"].per_rank_counts == [34, 34, 33]
    assert check.audits["pad"].n_duplicate_draws == 1 and not check.audits["pad"].missing
    assert len(check.audits["drop"].missing) == 2 and not check.audits["drop"].duplicated
    assert check.audits["none"].n_duplicate_draws > 0  # no distributed sampler: overlap


def _consumed_twice():
    # rank 1 re-reads rank 0's shard: the audit must say which indices and ranks
    sampler = gs.DistributedSampler(range(10), rank=0 if gs.rank() == 1 else gs.rank(),
                                    num_replicas=2, mode="exact")
    return gs.audit_indices(list(sampler), 10)


def test_audit_reports_overlap_and_missing_on_every_rank():
    audits = gs.spawn(_consumed_twice, 2)
    assert audits[0] == audits[1]
    a = audits[0]
    assert not a.is_partition
    shard0 = sorted(gs.DistributedSampler(range(10), rank=0, num_replicas=2, mode="exact"))
    assert len(shard0) == 5 and sorted(a.duplicated) == shard0  # rank 0's shard, read by both
    assert all(ranks == [0, 1] for ranks in a.duplicated.values())
    assert sorted(a.missing) == sorted(set(range(10)) - set(shard0))
