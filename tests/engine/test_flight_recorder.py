"""A hang names its culprit: a rank that sleeps, one that skips a collective, one that dies.

Each case is a real 2-process gloo run with a 3 s collective timeout (gloo raises on
the waiting rank); the waiting ranks write their flight records and the launcher's
error starts with the hang report (``gradsync/hang_report.py``) naming the rank that
is behind and the collective. Each run is bounded by that timeout, never by a hang.
"""

import os
import signal
import time

import pytest
import torch

import gradsync as gs
from gradsync.engine.transport import comm

TIMEOUT_S = 3


def _hang(case: str):
    x = torch.ones(4)
    comm.all_reduce(x, tag="a")
    if gs.rank() == 1:
        if case == "sleep":
            time.sleep(60)
        elif case == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        elif case == "skip":  # skips 'b' and waits for a message rank 0 never sends
            comm.exchange("recv", x, [], [(x, 0)], tag="c", p2p_tag=7)
            return "unreachable"
    comm.all_reduce(x, tag="b")
    return "unreachable"


def _report(case: str, tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("GRADSYNC_FLIGHT_DIR", str(tmp_path))
    with pytest.raises(gs.WorkerFailedError) as info:
        gs.spawn(_hang, 2, case, timeout_s=TIMEOUT_S)
    text = str(info.value)
    assert text.startswith("hang report"), text
    report = text.split("\nworker rank")[0]
    print(f"--- {case} ---\n{report}")
    assert (tmp_path / "attempt-0" / "rank-0.json").exists()
    return report


def test_a_sleeping_rank_is_named_behind(tmp_path, monkeypatch):
    report = _report("sleep", tmp_path, monkeypatch)
    assert "rank 0 waited" in report and "all_reduce #2 'b'" in report
    assert "rank 1 is behind: it never issued #2 on group world" in report
    assert "all ranks completed all_reduce #1 'a'" in report


def test_a_rank_that_skips_a_collective_is_named(tmp_path, monkeypatch):
    report = _report("skip", tmp_path, monkeypatch)
    assert (tmp_path / "attempt-0" / "rank-1.json").exists()  # both ranks waited
    assert "all_reduce #2 'b'" in report and "recv #2 'c'" in report
    assert "instead, and waits in it: one of them skipped a collective" in report


def test_a_dead_rank_is_named_with_how_it_died(tmp_path, monkeypatch):
    report = _report("dies", tmp_path, monkeypatch)
    assert "rank 1 is behind: it never issued #2" in report
    assert "SIGKILL" in report
