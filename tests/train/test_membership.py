"""torchrun ``--nnodes 1:2``: a node joins a running job and later dies; the run goes on.

Two torchrun agents on this machine (one "node" each, 2 workers each) share a c10d
rendezvous. Agent A starts alone (2 workers). When agent B arrives, A's agent
sees a node waiting and restarts its workers; the new group of 4 continues from
the last checkpoint (``--resume auto``, nothing changed on the command line). Then
B is SIGKILLed with its workers: A's workers fail, A's agent restarts them
(``--max-restarts``), and the group of 2 continues again. The global batch stays
16, so the float64 trajectory must equal an uninterrupted 2-worker run's to 1e-12
and every step must appear once in ``metrics.jsonl``.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on the agents: with torch 2.13's default
(the rendezvous store shared with the workers), an agent that joins a running job
waits for the new round's ``MASTER_ADDR``, which the running rank-0 agent, holding
its first round's bootstrap information, never writes again; both time out
(``DistStoreError ... keys: /torch.rendezvous.membership.1/MASTER_ADDR``). The
README gives the same setting with the ``--nnodes MIN:MAX`` command.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradsync.cli import main as cli_main
from gradsync.rundir import METRICS, read_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 48
TRAIN = ["-m", "gradsync.train", "--model", "tests.train.factories:slow64",
         "--data", "tests.train.factories:regression64", "--optimizer", "sgd", "--lr", "0.05",
         "--steps", str(STEPS), "--global-batch", "16", "--micro-batch", "2",
         "--checkpoint-every", "1", "--eval-every", "0", "--no-report", "--timeout", "60"]


def _env(forward_s=0.15):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT), "GRADSYNC_TEST_FORWARD_S": str(forward_s),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(port, out, log, host, forward_file):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "membership",
           "--rdzv-conf", f"is_host={int(host)},last_call_timeout=1,join_timeout=60",
           "--local-addr", "127.0.0.1", "--max-restarts", "3", "--monitor-interval", "0.2",
           *TRAIN, "--out", str(out)]
    env = {**_env(), "GRADSYNC_TEST_FORWARD_FILE": str(forward_file)}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def _steps(out):
    try:
        return read_metrics(str(out / METRICS))[0]
    except (OSError, ValueError):
        return []


def _wait(cond, timeout, what, logs):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n"
                         + "\n".join(p.read_text()[-3000:] for p in logs))


def _kill(proc):
    """SIGKILL an agent and its workers (torchrun starts them in sessions of their own)."""
    if proc.poll() is None:
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        for pid in workers:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _straight(out, monkeypatch):
    """The uninterrupted 2-worker run of the same flags, through ``gradsync.cli.main`` in
    this process (the same parser and worker loop as ``-m gradsync.train``): its workers
    fork from this process's forkserver while agent A's interpreters still import torch,
    where a torchrun run of its own before A took 10-15 s."""
    with monkeypatch.context() as m:
        m.setenv("GRADSYNC_TEST_FORWARD_S", "0")
        assert cli_main(["train", *TRAIN[2:], "--workers", "2", "--out", str(out)]) == 0


@pytest.mark.timeout(420)
def test_a_node_joins_and_a_node_dies_and_the_run_stays_exact(tmp_path, monkeypatch):
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    port, logs = _port(), [tmp_path / "a.log", tmp_path / "b.log"]
    forward = tmp_path / "forward_s"  # the slow forward's delay, once it exists (factories)
    with open(logs[0], "w") as la, open(logs[1], "w") as lb:
        a = _agent(port, elastic, la, True, forward)
        b = None
        try:
            _straight(straight, monkeypatch)
            _wait(lambda: len(_steps(elastic)) >= 4, 120, "agent A's first steps", logs)
            b = _agent(port, elastic, lb, False, forward)
            _wait(lambda: any(s["world_size"] == 4 for s in _steps(elastic)), 120,
                  "the group of 4 after agent B joined", logs)
            grown = max(s["step"] for s in _steps(elastic))
            _wait(lambda: max(s["step"] for s in _steps(elastic)) >= grown + 3, 120,
                  "steps on 4 workers", logs)
            _kill(b)  # a node dies with its workers
            # the slow forward kept the run going until B had joined and died; the steps
            # after A's restart on 2 workers need no delay (they were ~15 s of sleeping)
            forward.with_suffix(".tmp").write_text("0")
            forward.with_suffix(".tmp").replace(forward)
            assert a.wait(timeout=240) == 0, logs[0].read_text()[-4000:]
        finally:
            _kill(a)
            if b is not None:
                _kill(b)
    text = logs[0].read_text()
    assert "(4 workers, was 2)" in text and "(2 workers, was 4)" in text, text[-4000:]

    rows = _steps(elastic)
    assert [s["step"] for s in rows] == list(range(1, STEPS + 1))  # each step once
    assert {s["world_size"] for s in rows} == {2, 4}
    ref = torch.load(straight / "checkpoint.pt", weights_only=False)
    got = torch.load(elastic / "checkpoint.pt", weights_only=False)
    assert got["step"] == STEPS and got["world_sizes"][0] == 2 and 4 in got["world_sizes"]
    gap = max(float((ref["model"][k] - got["model"][k]).abs().max()) for k in ref["model"])
    assert gap <= 1e-12, gap
