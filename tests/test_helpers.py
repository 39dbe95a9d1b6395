"""The job tables the multi-process tests share one spawn through: a test gets its job's
result by name, so adding or reordering jobs cannot hand it another job's result."""

import pytest
import torch

import gradsync as gs
from tests.helpers import (
    SharedSpawn,
    errors_of,
    job_results,
    job_table,
    max_gap,
    run_jobs,
    same_tensors,
)
from tests.parity_helpers import Job, spawn_jobs


def _double(x):
    return 2 * x


def _negate(x):
    return -x


def test_results_follow_names_not_positions():
    jobs = {"double": (_double, (3,)), "negate": (_negate, (3,))}
    swapped = dict(reversed(list(jobs.items())))
    for table in (jobs, swapped):
        per_rank = [run_jobs(table), run_jobs(table)]  # what gs.spawn returns, one per rank
        assert job_results(per_rank, "double") == [6, 6]
        assert job_results(per_rank, "negate") == [-3, -3]


def test_an_unknown_name_a_list_or_a_name_twice_is_an_error():
    per_rank = [run_jobs({"double": (_double, (1,))})]
    with pytest.raises(KeyError, match="'halve'.*the spawn ran \\['double'\\]"):
        job_results(per_rank, "halve")
    with pytest.raises(TypeError, match="name"):
        run_jobs([(_double, (1,))])  # positions are not names
    with pytest.raises(ValueError, match="twice"):
        job_table(("a", _double, (1,)), ("a", _negate, (1,)))
    assert job_table(("a", _double, [1])) == {"a": (_double, (1,))}


def test_an_empty_spawn_or_ranks_that_ran_different_jobs_are_errors():
    with pytest.raises(ValueError, match="returned nothing"):
        job_results([], "double")
    with pytest.raises(ValueError, match="rank 1 ran"):
        job_results([{"a": 1, "b": 2}, {"b": 2, "a": 1}], "a")


def test_parity_jobs_are_one_per_name_and_strategy():
    with pytest.raises(ValueError, match="twice"):  # before anything is spawned
        spawn_jobs(2, [Job("baseline", _double, "ddp"), Job("baseline", _negate, "ddp")])
    with pytest.raises(ValueError, match="no jobs"):
        spawn_jobs(2, [])


def test_comparisons_never_stop_at_the_shorter_list():
    one, two = [torch.zeros(2)], [torch.zeros(2), torch.ones(2)]
    assert not same_tensors(one, two) and same_tensors(two, list(two))
    with pytest.raises(AssertionError):
        max_gap(one, two)
    with pytest.raises(AssertionError):
        max_gap([], [])


def test_errors_of_names_each_case():
    def refuse():
        raise gs.UsageError("no")

    assert errors_of(fine=lambda: None, refused=refuse) == {"fine": None, "refused": "no"}


def _rank_times(x):
    return (gs.rank() + 1) * x


def test_shared_spawn_runs_once_per_world_and_reads_by_name():
    calls = []
    table = {"times": (_rank_times, (5,)), "negate": (_negate, (2,))}

    def jobs(world):
        calls.append(world)
        return table

    spawn = SharedSpawn(jobs, timeout_s=60)
    assert spawn.results("times", 2) == [5, 10]
    assert spawn.results("negate", 2) == [-2, -2]
    assert calls == [2]  # the second lookup reads the same spawn
    with pytest.raises(KeyError, match="no job named 'missing'"):
        spawn.results("missing", 2)
