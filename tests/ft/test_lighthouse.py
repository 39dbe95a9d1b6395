"""torchft's lighthouse with the settings gradsync derives: it waits for every live group.

In process, against torchft's real lighthouse (its Rust server, the same code as
``torchft_lighthouse``), with torchft's own client playing three replica groups
that heartbeat every 100 ms, as a group's manager does:

* the issue-35 cascade, reproduced with the old ``join_timeout_ms 1000``: a group
  that asks 1.5 s after the others (a heal, a slow step) is left out, and at the
  next quorum its aged request lets the first asker start with it alone, leaving
  out a third group that is only 50 ms behind; with the derived settings both
  quorums hold all three;
* a group that stops heartbeating (it died) is dropped after the heartbeat
  timeout, not after the join timeout: the survivors' pause stays about 1 s;
* the status page gradsync reads (who heartbeats, the last quorum and its steps)
  and the decision a group that comes back after the job's end takes from it;
* ``gradsync lighthouse --print``: the cluster's lighthouse command with the same
  settings.
"""

from __future__ import annotations

import shlex
import threading
import time
from datetime import timedelta

import pytest

from gradsync.ft.lighthouse import LighthouseSettings, settings_for, start_lighthouse
from gradsync.ft.lighthouse_status import group_of, parse, read_status
from gradsync.ft.replica import job_over
from gradsync.ft.requirement import torchft

pytestmark = pytest.mark.timeout(120)

IDS = [f"gradsync_group_{g}:test{g}" for g in range(3)]


class Groups:
    """Three replica ids heartbeating to a lighthouse (``alive``), asking for quorums."""

    def __init__(self, address: str, alive=IDS):
        tf = torchft()
        self.client = tf._torchft.LighthouseClient(address, timedelta(seconds=5))
        self.alive = set(alive)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._beats, daemon=True)
        self._beat.start()

    def _beats(self):
        while not self._stop.is_set():
            for rid in list(self.alive):
                self.client.heartbeat(rid)
            time.sleep(0.1)

    def ask(self, rid: str, out: dict, step: int = 0) -> None:
        try:
            q = self.client.quorum(replica_id=rid, timeout=timedelta(seconds=30), address="a",
                                   store_address="s", step=step, world_size=1,
                                   shrink_only=False)
        except RuntimeError:  # still waiting when the test shut the lighthouse down
            return
        out[rid] = sorted(group_of(p.replica_id) for p in q.participants)

    def round(self, delays: dict[str, float], step: int = 0, wait: bool = True):
        """Each id in ``delays`` asks after its delay; {id: the quorum's groups}."""
        out: dict[str, list[int]] = {}
        threads = []
        for rid, d in delays.items():
            t = threading.Timer(d, self.ask, (rid, out, step))
            t.start()
            threads.append(t)
        if wait:
            for t in threads:
                t.join(timeout=60)
        return out, threads

    def close(self):
        self._stop.set()
        self._beat.join(timeout=5)


def test_the_old_join_timeout_leaves_a_late_group_out_and_then_a_punctual_one():
    """Measured mechanism of issue 35 (torchft's quorum_compute, join timeout 1 s)."""
    light = start_lighthouse(LighthouseSettings(min_replicas=2, join_timeout_ms=1000))
    groups = Groups(light.address)
    try:
        time.sleep(0.3)
        first, _ = groups.round({rid: 0.0 for rid in IDS})
        assert first[IDS[0]] == [0, 1, 2]
        second, _ = groups.round({IDS[0]: 0.0, IDS[1]: 0.0}, wait=False)
        time.sleep(1.5)  # group 2 is 1.5 s late: the quorum formed after 1 s without it
        late: dict[str, list[int]] = {}
        t_late = threading.Thread(target=groups.ask, args=(IDS[2], late), daemon=True)
        t_late.start()
        deadline = time.monotonic() + 10
        while len(second) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert second[IDS[0]] == [0, 1]
        time.sleep(2.0)  # the step of groups 0 and 1; group 2's request ages meanwhile
        third, _ = groups.round({IDS[0]: 0.0, IDS[1]: 0.05}, wait=False)
        deadline = time.monotonic() + 10
        while IDS[0] not in third and time.monotonic() < deadline:
            time.sleep(0.01)
        # prev quorum {0, 1} incomplete, group 2's request 2 s old > 1 s: group 0 and the
        # waiting group 2 form it at once, and group 1, 50 ms behind, is left out
        assert third[IDS[0]] == [0, 2], third
        t_late.join(timeout=10)
        assert late[IDS[2]] == [0, 2]
    finally:
        groups.close()
        light.shutdown()


def test_the_derived_settings_keep_every_heartbeating_group():
    light = start_lighthouse(settings_for(3, 60))
    groups = Groups(light.address)
    try:
        time.sleep(0.3)
        first, _ = groups.round({rid: 0.0 for rid in IDS})
        assert first[IDS[0]] == [0, 1, 2]
        t0 = time.monotonic()
        second, _ = groups.round({IDS[0]: 0.0, IDS[1]: 0.0, IDS[2]: 1.5})
        assert all(q == [0, 1, 2] for q in second.values()), second  # waited for the late one
        assert 1.4 < time.monotonic() - t0 < 20
        third, _ = groups.round({IDS[0]: 0.0, IDS[1]: 0.05, IDS[2]: 0.1})
        assert all(q == [0, 1, 2] for q in third.values()), third
        # a group that dies stops heartbeating: dropped after the heartbeat timeout (1 s),
        # not after the join timeout (60 s)
        groups.alive.discard(IDS[2])
        t0 = time.monotonic()
        fourth, _ = groups.round({IDS[0]: 0.0, IDS[1]: 0.0})
        waited = time.monotonic() - t0
        assert fourth[IDS[0]] == [0, 1]
        assert 0.5 < waited < 10, waited
    finally:
        groups.close()
        light.shutdown()


def test_the_status_page_and_the_job_over_decision():
    light = start_lighthouse(settings_for(3, 60))
    groups = Groups(light.address, alive={IDS[0], IDS[2]})
    try:
        time.sleep(0.5)
        status = read_status(light.address)
        assert status is not None and status.quorum_id == 0 and not status.members
        assert status.alive_groups() == {0, 2}
        assert job_over(status, 6, 1, 4) == ""  # no quorum yet
        done, _ = groups.round({IDS[0]: 0.0, IDS[2]: 0.0}, step=6)  # groups 0, 2 at step 6
        assert done[IDS[0]] == [0, 2]
        status = read_status(light.address)
        assert status.quorum_id == 1 and status.member_groups() == {0: 6, 2: 6}
        assert status.members_alive()
        assert job_over(status, 6, 1, 4) == ""  # they are alive: group 1 is taken in
        groups.alive = set()  # they finished and left
        time.sleep(1.5)
        status = read_status(light.address)
        assert status.alive_groups() == set() and not status.members_alive()
        note = job_over(status, 6, 1, 4)
        assert "job ended (step 6, groups 0, 2)" in note and "stops at its step 4" in note
        assert job_over(status, 7, 1, 4) == ""  # their quorum was not the job's end
    finally:
        groups.close()
        light.shutdown()
    assert parse("<html>something else</html>") is None


def test_gradsync_lighthouse_prints_the_derived_command(capsys):
    from gradsync.cli import main

    assert main(["lighthouse", "--ft-groups", "5", "--timeout", "120", "--print"]) == 0
    assert shlex.split(capsys.readouterr().out) == [
        "torchft_lighthouse", "--min_replicas", "3", "--join_timeout_ms", "120000",
        "--heartbeat_timeout_ms", "1000", "--quorum_tick_ms", "50", "--bind", "[::]:29510"]
    assert main(["lighthouse", "--ft-groups", "3", "--bind", "nowhere"]) == 2
    assert "--bind takes HOST:PORT" in capsys.readouterr().err
