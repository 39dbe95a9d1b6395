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
    if case == "dies-while-busy":  # rank 0 computes for a second; rank 1 dies meanwhile
        if gs.rank() == 0:
            time.sleep(1.0)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
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


def test_a_peer_busy_computing_when_a_rank_dies_still_records_its_wait(tmp_path, monkeypatch):
    """torch's process context stops the other workers the moment one fails; a peer that
    was computing then never reached the collective that would have named the dead rank
    (on a loaded CI machine, even a peer already waiting lost that race). The launcher
    lets the survivors record first (``launch._let_peers_record``)."""
    report = _report("dies-while-busy", tmp_path, monkeypatch)
    assert "rank 0 waited" in report and "all_reduce #2 'b'" in report
    assert "rank 1 is behind: it never issued #2" in report and "SIGKILL" in report


def _in_flight_job(flight_dir: str) -> dict:
    """On NCCL a stuck collective never fails on the host (NCCL's watchdog aborts the
    process at the timeout); the in-flight watchdog writes the ring before that.
    Emulated on gloo: rank 0 issues an all-reduce rank 1 joins only later."""
    import json
    import os
    import time

    import torch.distributed as dist

    from gradsync.engine.transport import comm, flight_recorder

    os.environ["GRADSYNC_FLIGHT_DIR"] = flight_dir
    flight_recorder.watch(timeout_s=2.0, period_s=0.1)
    t = torch.ones(4)
    out = {}
    if dist.get_rank() == 0:
        pending = comm.all_reduce(t, async_op=True, tag="stuck")
        path = os.path.join(flight_dir, "attempt-0", "rank-0.json")
        deadline = time.time() + 20
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.1)
        out["record"] = json.load(open(path)) if os.path.exists(path) else None
        pending.wait()
    else:
        time.sleep(4.0)  # past the watchdog's 1.5 s; then the all-reduce completes
        comm.all_reduce(t, tag="stuck")
    out["sum"] = t.tolist()
    return out


def test_a_collective_stuck_on_the_device_is_recorded_before_the_watchdog_abort(tmp_path):
    res = gs.spawn(_in_flight_job, 2, str(tmp_path), timeout_s=60)
    rec = res[0]["record"]
    assert rec is not None, "no flight record written while the collective was in flight"
    assert rec["stuck"]["tag"] == "stuck" and rec["stuck"]["op"] == "all_reduce", rec["stuck"]
    assert "not completed on the device" in rec["error"], rec["error"]
    assert res[0]["sum"] == res[1]["sum"] == [2.0] * 4
