"""The cluster form from start to end: a start barrier, and a group left out of the last step
that still ends with the final model and exit code 0.

torchft's own ``torchft_lighthouse`` with the settings ``gradsync lighthouse --print``
derives, and one ``gradsync train --ft-group i`` per group (its own launcher, run
directory and ``--max-restarts``), as on a cluster; 1 s steps (``slow64``, two
forwards of 0.5 s):

* group 2 starts 6 s after the others; the start barrier (every group heartbeats
  before anyone asks) puts all three in the first quorum, and no group heals;
* group 2's whole launcher is SIGKILLed once step 7 is committed, so it is out of
  step 8, and started again only after the others committed step 8: they hold the
  final model in closing rounds (``ft/closing.py``), group 2 resumes its step-4
  checkpoint, joins a round and heals into the end. Before issue 35 it waited for
  a quorum that could no longer form until ``--timeout``, in a restart loop.

Every group exits 0 with the uninterrupted run's model (1e-12); no live group was
left out of any step (``gradsync.ft.membership``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.ft.lighthouse import settings_for
from gradsync.rundir import METRICS, read_metrics_file

from .helpers import ROOT, SLOW, TRAIN, env, final_model, max_diff, membership

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last(run: Path) -> int:
    rows = read_metrics_file(str(run / METRICS)).records
    return max((r["step"] for r in rows if "loss" in r), default=0)


def _until(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"waited {seconds:.0f} s for {what}"
        time.sleep(0.05)


def test_a_group_left_out_of_the_last_step_ends_with_the_final_model(tmp_path, straight):
    model, _ = straight
    port = _free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    light = subprocess.Popen([str(binary), *settings_for(3, 60).argv(f"127.0.0.1:{port}")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logs = {g: tmp_path / f"group-{g}.log" for g in range(3)}

    def start(g: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "gradsync", "train", *TRAIN, *SLOW, "--workers", "1",
               "--max-restarts", "1", "--ft-groups", "3", "--ft-group", str(g),
               "--ft-lighthouse", f"127.0.0.1:{port}", "--out", str(tmp_path / f"group-{g}")]
        with open(logs[g], "a") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=env(GRADSYNC_TEST_FORWARD_S="0.5"),
                                    start_new_session=True)

    procs: dict[int, subprocess.Popen] = {}
    try:
        procs[0], procs[1] = start(0), start(1)
        time.sleep(6)  # group 2 starts late: the others wait for it at the start
        procs[2] = start(2)
        _until(lambda: _last(tmp_path / "group-0") >= 7, 150, "step 7")
        os.killpg(procs[2].pid, signal.SIGKILL)  # its launcher and worker, at once
        procs[2].wait(timeout=30)
        killed = time.time()
        _until(lambda: _last(tmp_path / "group-0") >= 8, 60, "the others' step 8")
        time.sleep(2)  # they are in their closing rounds now
        assert procs[0].poll() is None, "group 0 left while group 2 lacked the final model"
        procs[2] = start(2)
        codes = [procs[g].wait(timeout=150) for g in range(3)]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        light.kill()
        light.wait()
    text = {g: logs[g].read_text() for g in range(3)}
    assert codes == [0, 0, 0], "\n".join(t[-3000:] for t in text.values())
    for g in range(3):
        assert max_diff(final_model(tmp_path / f"group-{g}"), model) <= 1e-12, g
    assert "healed into the job's end (step 8)" in text[2]
    steps, counts = membership(tmp_path, 3, [(2, killed - 1.0, 0.0)])
    assert [s.members for s in steps[:7]] == [(0, 1, 2)] * 7, counts  # barrier: all from step 1
    assert steps[7].members == (0, 1)  # step 8 without the group that was down
    assert counts["heals"] == 0 and counts["left_out_live"] == 0, counts
    ends = {g: [e for e in read_metrics_file(str(tmp_path / f"group-{g}" / METRICS)).events
                if e.get("event") == "end"] for g in range(3)}
    assert ends[2][-1]["healed"] and ends[2][-1]["final"], ends[2]
    assert all(ends[g][-1]["members"] == [0, 1, 2] for g in range(3)), ends
