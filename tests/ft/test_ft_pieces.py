"""The pure pieces of issue 35's fault tolerance, in process and without a lighthouse.

* ``ft.membership``: a group missing from a step is a live group left out unless a
  fault of its covers the step's start (a window from the fault until the group
  asked again, or its link was back); steps read from every group's rows, a heal
  counted once per group, disagreeing quorums reported;
* ``ft.closing``: the launcher's marks of gone groups;
* ``ft.addresses``: on one machine nothing is refused; with a lighthouse on another
  host, a name that resolves to loopback or not at all is refused in one line that
  names it.
"""

from __future__ import annotations

import json

import pytest

from gradsync.errors import UsageError
from gradsync.ft.addresses import check_addresses, is_loopback
from gradsync.ft.closing import gone_groups, mark_gone
from gradsync.ft.membership import Window, down_windows, job_steps, left_out, summary


def _write(tmp, g: int, rows: list[dict]) -> None:
    d = tmp / f"group-{g}"
    d.mkdir(exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(step, quorum, t, healed=None, quorum_s=0.0):
    return {"step": step, "loss": 1.0, "quorum": quorum, "unix_time": t, "step_time_s": 2.0,
            "quorum_s": quorum_s, "healed": healed}


def test_membership_tells_a_live_group_left_out_from_a_down_one(tmp_path):
    # step s ends at 100 + 2s and starts 2 s earlier; group 2 killed at t=103.5 (in step 3's
    # first attempt), it asks again at t=106.5 (its first row after: step 5, ending at 110
    # after a 1.5 s wait) and heals at step 5; group 1 is missing from step 6 with no
    # fault of its own
    for g in range(3):
        rows = []
        for step in range(1, 8):
            t = 100 + 2 * step
            quorum = ([0, 1, 2] if step < 3 or step == 5 or step == 7 else
                      [0, 1] if step in (3, 4) else [0, 2])
            if g in quorum:
                rows.append(_row(step, quorum, t, healed=(g == 2 and step == 5) or None,
                                 quorum_s=1.5 if (g == 2 and step == 5) else 0.0))
        _write(tmp_path, g, rows)
    steps = job_steps(tmp_path, 3)
    assert [s.step for s in steps] == list(range(1, 8))
    assert steps[4].healed == (2,) and steps[5].members == (0, 2)
    windows = down_windows(tmp_path, 3, [(2, 103.5, 0.0)])
    assert windows == [Window(2, 103.5, 110 - 2.0 - 1.5)]
    assert left_out(steps, 3, windows) == [(6, 1)]  # steps 3, 4 without group 2: it was down
    counts = summary(steps, 3, windows)
    assert counts["heals"] == 1 and counts["missing"] == 3 and counts["full_steps"] == 4
    assert counts["left_out_live"] == 1 and not counts["disagree"]
    # a partition's window lasts at least until the link is back
    assert down_windows(tmp_path, 3, [(2, 103.5, 20.0)])[0].end == 123.5


def test_membership_reports_quorums_that_disagree(tmp_path):
    _write(tmp_path, 0, [_row(1, [0, 1], 10.0)])
    _write(tmp_path, 1, [_row(1, [1, 2], 10.0)])  # a split brain would look like this
    _write(tmp_path, 2, [])
    assert summary(job_steps(tmp_path, 3), 3, [])["disagree"] == [1]


def test_the_launchers_gone_marks(tmp_path):
    assert gone_groups(None, 3) == set() and gone_groups(str(tmp_path / "none"), 3) == set()
    mark_gone(str(tmp_path), 1)
    mark_gone(str(tmp_path), 7)  # not a group of this job
    (tmp_path / "group-0.rank-0").write_text("")
    assert gone_groups(str(tmp_path), 3) == {1}


def test_names_other_groups_reach_this_one_by_must_not_be_loopback_on_a_cluster():
    assert is_loopback("127.0.1.1") and is_loopback("::1") and not is_loopback("10.0.0.2")
    check_addresses("http://127.0.0.1:29510", "localhost", "anything")  # one machine
    check_addresses("http://10.1.2.3:29510", "10.1.2.4", "10.1.2.4")  # a cluster, reachable
    with pytest.raises(UsageError, match="MASTER_ADDR 'localhost' resolves to 127.0.0.1"):
        check_addresses("http://10.1.2.3:29510", "localhost", "10.1.2.4")
    with pytest.raises(UsageError, match="this host's name '127.0.1.1' resolves to 127.0.1.1"):
        check_addresses("http://10.1.2.3:29510", "10.1.2.4", "127.0.1.1")
    with pytest.raises(UsageError, match="does not resolve here"):
        check_addresses("http://no-such-host.invalid:29510", "10.1.2.4", "10.1.2.4")
