"""`gradsync train` end to end: real launcher, real files, real signals."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from gradsync.cli import main as cli_main
from tests.cli_in_process import cli_here

CLI = [sys.executable, "-m", "gradsync.cli"]
FAST = ["--steps", "6", "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2",
        "--checkpoint-every", "3", "--no-report", "--eval-every", "0"]  # no assertion reads them


def run_cli(*args, timeout=120, env=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def train_here(*args):
    """`gradsync train` through ``gradsync.cli.main`` in this process, for a run whose
    output no assertion reads (a reference, a starting point): the same parser, launcher
    and workers, forked from this process's forkserver instead of a new interpreter that
    imports torch and starts its own (about 5 s a run)."""
    assert cli_main(["train", *args]) == 0


def test_train_writes_metrics_checkpoint_and_summary(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *FAST, "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert all(m["items"] == 8 * 32 for m in lines)  # tokens of the global batch
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 6 and ckpt["world_size"] == 2
    assert not any(k.startswith("module.") for k in ckpt["model"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accumulation"] == 2 and summary["final_loss"] < lines[0]["loss"]
    assert "final loss" in r.stdout and not list(out.glob(".tmp-*"))


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(tmp_path, capfd):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    train_here(*FAST, "--out", str(straight))
    r = cli_here("train", *FAST, "--out", str(broken), capfd=capfd,
                 env={"GRADSYNC_FAULT": "1:4:raise"})
    code, err = r.returncode, r.stderr
    assert code == 1, err
    assert "error: injected fault on rank 1 at step 5 (worker rank 1)" in err
    assert "continue from step 3 with: gradsync train --steps 6" in err
    assert torch.load(broken / "checkpoint.pt", weights_only=False)["step"] == 3
    r = run_cli("train", *FAST, "--out", str(broken))  # the same command continues
    assert r.returncode == 0, r.stderr
    assert "resuming from step 3 of 6 (2 workers, was 2)" in r.stdout
    a = torch.load(straight / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(broken / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the lost step 4 was cut, not kept twice


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_sharded_strategies_resume_exactly(tmp_path, strategy, capfd):
    """ZeRO checkpoints: optimizer shards per rank plus checkpoint.pt naming them."""
    args = [*FAST, "--strategy", strategy]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    train_here(*args, "--out", str(straight))
    r = cli_here("train", *args, "--out", str(broken), capfd=capfd,
                 env={"GRADSYNC_FAULT": "0:4:raise"})
    code, err = r.returncode, r.stderr
    assert code == 1 and "injected fault" in err, err
    r = run_cli("train", *args, "--out", str(broken))
    assert r.returncode == 0, r.stderr
    assert f"memory ({strategy}" in r.stdout
    held = dict(re.findall(r"^  (gradients|optimizer state) +([0-9.]+) MiB", r.stdout, re.M))
    assert float(held["gradients"]) > 0 and float(held["optimizer state"]) > 0, r.stdout
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(broken / "checkpoint.pt", weights_only=False)
    assert a["optimizer_shards"] and b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert not any(k.startswith("module.") for k in a["model"])
    assert [p.name for p in (broken / "checkpoint-shards").iterdir()] == ["step-0000006"]


@pytest.mark.parametrize("kind,expect,strategy", [
    ("exit", "exited with code 7", "ddp"),
    ("kill", "killed by signal SIGKILL", "ddp"),
    ("kill", "killed by signal SIGKILL", "zero3")])  # peers blocked in point-to-point
def test_worker_dying_mid_step_is_named(tmp_path, kind, expect, strategy, capfd):
    r = cli_here("train", *FAST, "--strategy", strategy, "--out", str(tmp_path / "r"),
                 "--timeout", "30", env={"GRADSYNC_FAULT": f"0:2:{kind}"}, capfd=capfd)
    code, err = r.returncode, r.stderr
    assert code == 1, err
    assert "worker rank 0 failed" in err and expect in err, err


def _as_from_a_terminal():
    """SIGINT at its default, as a shell in a terminal starts a command: a test run
    started in the background by a script inherits SIGINT ignored (POSIX), and a
    process that ignores SIGINT rightly stays deaf to Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_last_checkpoint_and_leaves_no_temporary_files(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([*CLI, "train", "--steps", "400", "--seq-len", "32",
                             "--global-batch", "8", "--micro-batch", "4",
                             "--checkpoint-every", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 90
        while not (out / "checkpoint.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "is intact" in err
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] >= 2 and ckpt["step"] % 2 == 0
    assert not list(out.glob(".tmp-*"))


def _forkserver_of(session: int) -> int | None:
    """The pid of the multiprocessing forkserver in this process session, if it exists yet."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"multiprocessing.forkserver import main" in cmd and os.getsid(int(pid)) == session:
                return int(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return None


def _has_loaded_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("moment", ["interpreter startup", "importing torch"])
def test_ctrl_c_while_workers_start_is_one_line_and_leaves_no_process(moment, tmp_path):
    """Ctrl-C while the forkserver starts or imports torch: no traceback from it, nothing left."""
    proc = subprocess.Popen([*CLI, "train", *FAST, "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while (pid := _forkserver_of(proc.pid)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pid is not None, "no forkserver started"
        while moment == "importing torch" and not _has_loaded_torch(pid):
            assert time.monotonic() < deadline, "the forkserver never loaded torch"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted" in err
    deadline = time.monotonic() + 30
    while _forkserver_of(proc.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _forkserver_of(proc.pid) is None, "the forkserver outlived the launcher"


def test_ctrl_c_while_the_cli_imports_torch_is_one_line(tmp_path):
    proc = subprocess.Popen([*CLI, "train", *FAST, "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while not _has_loaded_torch(proc.pid):
            assert time.monotonic() < deadline, "the CLI never loaded torch"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err, err


BAD_ARGUMENTS = [
    (["--global-batch", "30", "--micro-batch", "8"], "not a multiple"),
    (["--workers", "2", "--data", "random-tokens", "--seq-len", "1500000"],
     "fewer than one global batch"),
    (["--model", "mlp", "--data", "pysrc"], "does not fit"),
    (["--steps", "0"], "--steps must be"),
    (["--bucket-cap-mb", "-3"], "--bucket-cap-mb must be"),
    (["--bucket-mb", "auto", "--strategy", "zero1"], "needs --strategy ddp"),  # the old name
    (["--model", "tests.train.factories:tiny64"], "needs --data"),
] + ([] if torch.cuda.is_available() else [(["--backend", "nccl"], "needs CUDA")])


@pytest.mark.parametrize("args,expect", BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_one_line(args, expect, tmp_path, capfd):
    r = cli_here("train", *args, "--out", str(tmp_path / "x"), capfd=capfd)
    code, err = r.returncode, r.stderr
    assert code == 2, err
    assert expect in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_bad_arguments_as_a_real_command(tmp_path):
    args, expect = BAD_ARGUMENTS[0]
    r = run_cli("train", *args, "--out", str(tmp_path / "x"))
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("flag,expect", [(["--backend", "mpi"], "invalid choice"),
                                         (["--model", "resnet"], "unknown model 'resnet'")])
def test_unknown_choice_rejected_by_parser(flag, expect, capfd):
    r = cli_here("train", *flag, capfd=capfd)
    code, err = r.returncode, r.stderr
    assert code == 2 and expect in err and "Traceback" not in err


def test_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("train", *FAST, "--port", str(port), "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and f"port {port}" in r.stderr and "already in use" in r.stderr


def test_resume_modes_and_a_finished_run(tmp_path, capfd):
    """Every answer here is the launcher's, before any worker starts: in this process."""
    out = tmp_path / "run"
    r = cli_here("train", *FAST, "--out", str(out), "--resume", capfd=capfd)  # nothing to continue
    assert r.returncode == 2 and "--resume: no checkpoint" in r.stderr
    train_here(*FAST, "--out", str(out))
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix != ".lock"}
    r = cli_here("train", *FAST, "--out", str(out), capfd=capfd)  # finished: changes nothing
    assert r.returncode == 0 and "already finished (step 6 of 6); nothing to do" in r.stdout
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in files} == files
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] is not None
    r = cli_here("train", *FAST, "--out", str(out), "--resume", "never", capfd=capfd)
    assert r.returncode == 2 and "already holds a checkpoint (step 6)" in r.stderr
    r = cli_here("train", *FAST, "--out", str(out), "--seed", "1", "--steps", "8", capfd=capfd)
    assert r.returncode == 2 and "different run: --seed was 0, now 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


HELP_WALK = """
import argparse, contextlib, io, json, sys
from gradsync.cli import build_parser, main

def paths(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from paths(sub, prefix + [name])

out = {}
for path in list(paths(build_parser(), []))[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            code = main(path + ["--help"])
        except SystemExit as e:
            code = e.code
    out[" ".join(path)] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def test_help_on_every_subcommand():
    """Every command and sub-command (``plan memory``, ``netlab run``, ...) answers
    ``--help`` with its usage and exit code 0; one process walks the parser tree
    through ``gradsync.cli.main`` (a process per command took half a minute)."""
    from gradsync.cli import COMMANDS

    r = subprocess.run([sys.executable, "-c", HELP_WALK], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    helps = json.loads(r.stdout.strip().splitlines()[-1])
    assert {name for name, _ in COMMANDS} <= set(helps), sorted(helps)
    assert {"plan memory", "netlab run"} <= set(helps), sorted(helps)
    for path, (code, text) in helps.items():
        assert code == 0 and text.startswith("usage: gradsync " + path), (path, code, text[:200])
    assert run_cli("train", "--help", timeout=60).stdout.startswith("usage: gradsync train")


def test_corrupt_checkpoint_is_named_on_resume(tmp_path):
    out = tmp_path / "run"
    train_here(*FAST, "--out", str(out))
    ckpt = out / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated, as by a full disk
    r = run_cli("train", *FAST, "--out", str(out), "--resume")
    assert r.returncode == 2, r.stderr
    assert "checkpoint.pt is unreadable" in r.stderr and "Traceback" not in r.stderr
