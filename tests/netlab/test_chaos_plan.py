"""The chaos schedules are pure functions of their seed: counts, steps, groups, rates."""

import pytest

from gradsync.errors import UsageError
from gradsync.netlab.chaos import at_rate, plan

pytestmark = pytest.mark.no_root


def test_plan_draws_each_kind_at_distinct_steps_never_the_same_group_twice_in_a_row():
    faults = plan(3, groups=3, first_step=5, last_step=60, workers=6, hosts=4, partitions=2)
    kinds = [f.kind for f in faults]
    assert (kinds.count("worker"), kinds.count("host"), kinds.count("partition")) == (6, 4, 2)
    steps = [f.after_step for f in faults]
    assert steps == sorted(steps) and len(set(steps)) == 12 and 5 <= steps[0] <= steps[-1] <= 60
    assert all(a.group != b.group for a, b in zip(faults, faults[1:]))
    assert {f.seconds for f in faults if f.kind == "partition"} == {8.0}  # > --ft-timeout 5 s
    assert plan(3, 3, 5, 60, workers=6, hosts=4, partitions=2) == faults  # seeded
    assert plan(4, 3, 5, 60, workers=6, hosts=4, partitions=2) != faults


def test_plan_refuses_more_faults_than_steps():
    with pytest.raises(UsageError, match="3 faults need 3 steps"):
        plan(0, 3, 10, 11, workers=3)


def test_at_rate_spaces_faults_evenly_from_the_start():
    faults = at_rate(0, groups=3, per_minute=4, duration_s=180, start_s=5)
    assert [f.at_s for f in faults] == [5 + 15 * k for k in range(12)]
    assert all(f.kind == "worker" and 0 <= f.group < 3 for f in faults)
    assert at_rate(0, 3, 0, 180) == []


def test_netlab_run_ft_groups_reads_gradsync_train_flags():
    from gradsync.cli.netlab_groups import chaos_counts, flag_value, train_flags

    assert train_flags(["-m", "gradsync.train", "--steps", "9"]) == ["--steps", "9"]
    assert train_flags(["--steps", "9"]) == ["--steps", "9"]
    with pytest.raises(UsageError, match="gradsync train on every host"):
        train_flags(["my_script.py", "--flag"])
    assert flag_value(["--steps", "5", "--steps=7"], "--steps", "0") == "7"  # the last wins
    assert flag_value(["--out", "a"], "--steps", "100") == "100"
    assert chaos_counts("3,1,2") == (3, 1, 2) and chaos_counts(None) == (0, 0, 0)
    with pytest.raises(UsageError, match="W,H,P"):
        chaos_counts("3,1")
