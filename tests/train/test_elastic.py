"""Chaos under torchrun: workers SIGKILLed three times, restarted by torchrun, same result.

``torchrun --max-restarts 3 -m gradsync.train`` with no resume flag: rank 1 is
killed mid-step in the first attempt, rank 0 is killed in the middle of a
checkpoint save in the second (its new file written, not yet made current), and
rank 0 mid-step in the third. Every restart must continue from the last complete
checkpoint by itself, and the final parameters must be bit-identical to an
uninterrupted run's (float64, SGD with momentum: a resume that lost the optimizer's
state, the sampler's position or a step would show). Every subprocess runs under a
timeout; the time from each kill to the next completed step is measured from
outside (line arrival times) and printed, not asserted.
"""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradsync.cli import main as cli_main
from gradsync.rundir import METRICS, read_metrics, read_metrics_file

ROOT = Path(__file__).resolve().parents[2]
# The agent looks at its workers once a second: a survivor blocked in a collective
# with the killed rank then sees the broken connection and says so before it is
# stopped (at 0.1 s, on a loaded machine, the agent stopped it first).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--monitor-interval", "1"]
TRAIN = ["-m", "gradsync.train", "--model", "tests.train.factories:tiny64",
         "--data", "tests.train.factories:regression64", "--optimizer", "sgd", "--lr", "0.05",
         "--steps", "10", "--global-batch", "12", "--micro-batch", "2",
         "--checkpoint-every", "2", "--eval-every", "5", "--no-report", "--timeout", "60"]
# RANK:STEPS-DONE:KIND@ATTEMPT -- killed during step 3, in step 4's save, during step 7
FAULTS = "1:2:kill@0,0:3:kill-in-save@1,0:6:kill@2"


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT), **extra}


def _run_timed(cmd, env, timeout):
    """Run ``cmd``; return (rc, [(arrival time, line)] of stdout+stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    reader.join(timeout=10)
    return proc.returncode, lines


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final checkpoint of one uninterrupted run of TRAIN, which every interrupted
    run of the same configuration must reproduce bit for bit.

    Run through ``gradsync.cli.main`` in this process, 2 workers: the same flags, parser
    and worker loop as torchrun's ``-m gradsync.train``, forked from this process's
    forkserver in a second instead of a torchrun agent and two fresh interpreters
    importing torch (about 12 s). The torchrun run below must still match it bit for bit,
    so the two launchers are held to the same result as well."""
    out = tmp_path_factory.mktemp("straight")
    assert cli_main(["train", *TRAIN[2:], "--workers", "2", "--out", str(out)]) == 0
    return torch.load(out / "checkpoint.pt", weights_only=False)


def _differing(a: dict, b: dict) -> list[str]:
    """The parameters that differ in any bit, or exist in one state only."""
    return sorted(a.keys() ^ b.keys()) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def test_three_kills_under_torchrun_end_bit_identical(tmp_path, straight):
    chaos = tmp_path / "chaos"
    rc, lines = _run_timed([*TORCHRUN, "--max-restarts", "3", *TRAIN, "--out", str(chaos)],
                           _env(GRADSYNC_FAULT=FAULTS), 300)
    text = "\n".join(x for _, x in lines)
    assert rc == 0, text[-4000:]
    kills = [(float(m.group(2)), m.group(1)) for m in
             re.finditer(r"injected fault (kill\S*) on rank \d at step \d+ \(attempt \d, "
                         r"t=([\d.]+)\)", text)]
    assert [k for _, k in kills] == ["kill", "kill-in-save", "kill"], text[-4000:]
    assert text.count("resuming from step 2 of 10 (2 workers, was 2)") == 2
    assert "resuming from step 6 of 10 (2 workers, was 2)" in text

    b = torch.load(chaos / "checkpoint.pt", weights_only=False)
    assert b["step"] == 10 and b["world_sizes"] == [2]
    assert _differing(straight["model"], b["model"]) == []
    steps = [m["step"] for m in read_metrics(str(chaos / METRICS))[0]]
    assert steps == list(range(1, 11))  # no step twice, none missing
    assert not list(chaos.glob(".tmp-*"))
    # each restart is seen (issue 23): a line and a record, the step it continued from
    restarts = read_metrics_file(str(chaos / METRICS)).events
    assert [(e["attempt"], e["step"]) for e in restarts] == [(1, 2), (2, 2), (3, 6)], restarts
    for n, step in ((1, 2), (2, 2), (3, 6)):
        assert f"gradsync train: restart {n}: the launcher restarted the workers" in text
        assert f"continuing from step {step}" in text
    # the ranks that lose a peer say so in one line each: no gloo traceback, no atexit noise
    assert "Traceback" not in text and "Exception ignored" not in text, text[-4000:]
    # gloo words a dead peer either way, depending on which read or write meets it first
    assert re.search(r"stopped: another worker failed \(Connection (reset|closed)", text), \
        text[-4000:]

    recovery, resumed = [], []  # kill -> restarted workers resumed -> next step completed
    for t_kill, kind in kills:
        t_resume = next((t for t, x in lines if t > t_kill and "resuming from step" in x), None)
        assert t_resume is not None, f"no resume after the {kind} at t={t_kill}"
        t_step = next((t for t, x in lines if t > t_resume and re.match(r"step \d+/10 +loss", x)),
                      None)
        assert t_step is not None, f"no step completed after the resume from the {kind}"
        resumed.append(t_resume - t_kill)
        recovery.append(t_step - t_kill)
    print(f"\nkill -> resumed: {', '.join(f'{s:.1f} s' for s in resumed)}; kill -> training "
          f"again (a step completed): {', '.join(f'{s:.1f} s' for s in recovery)}")


def test_gradsync_train_max_restarts_continues_after_a_kill(tmp_path, straight):
    """The same with gradsync's own launcher: ``gradsync train --max-restarts 1``, rank 1
    killed after step 4: the restarted run ends bit-identical to the uninterrupted one."""
    out = tmp_path / "run"
    args = [a for a in TRAIN[2:]]  # the flags, without "-m gradsync.train"
    r = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *args, "--out", str(out),
                        "--max-restarts", "1"], capture_output=True, text=True, timeout=180,
                       cwd=ROOT, env=_env(GRADSYNC_FAULT="1:4:kill"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 4 of 10 (2 workers, was 2)" in r.stdout
    b = torch.load(out / "checkpoint.pt", weights_only=False)
    assert b["step"] == 10 and b["world_sizes"] == [2]
    assert _differing(straight["model"], b["model"]) == []
    assert [m["step"] for m in read_metrics(str(out / METRICS))[0]] == list(range(1, 11))
    # the restart is seen (issue 23): which rank died, how, when, the step continued from
    assert re.search(r"gradsync train: restart 1 of 1: worker rank 1 was killed by signal SIGKILL "
                     r"at \d\d:\d\d:\d\d during step 5; continuing from step 4", r.stdout), r.stdout
    (event,) = read_metrics_file(str(out / METRICS)).events
    assert event["event"] == "restart" and event["step"] == 4 and event["attempt"] == 1
    assert event["failed"][0]["rank"] == 1 and event["failed"][0]["signal"] == "SIGKILL"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (out / "restart.json").exists()
