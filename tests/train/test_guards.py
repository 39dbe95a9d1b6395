"""Nothing corrupt goes unnoticed, no run directory trouble ends in a traceback.

Real files, real mounts: a flipped byte inside a checkpoint's tensor data, a
learning rate that diverges to NaN, a NaN skipped on every rank, ``--out`` that
is a file, a read-only file system (a tmpfs mounted ``ro``: root ignores mode
bits, not a read-only mount), a full one (a 3 MiB tmpfs the preflight is told has
room: the first checkpoint fits, the second does not), a second run on a locked
directory and a stale lock.
Each gives its one-line message and exit code, and the last good checkpoint
stays as it was. Mount tests skip, with the reason, where mounting is not allowed.
"""

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.cli import main as cli_main
from gradsync.train.checkpoint import guard
from gradsync.train.checkpoint.format import verify
from gradsync.train.checkpoint.guard import RunLock, check_run_dir
from tests.cli_in_process import cli_here

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "gradsync.cli", "train"]
TINY = ["--model", "tests.train.factories:tiny32", "--data", "tests.train.factories:regression32",
        "--optimizer", "sgd", "--global-batch", "12", "--micro-batch", "2", "--eval-every", "0",
        "--no-report", "--timeout", "60", "--lr", "0.05"]


def run_cli(*args, env=None, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def train_here(*args, env=None):
    """`gradsync train` through ``gradsync.cli.main`` in this process, for a run whose
    output no assertion reads (a reference, a starting point): the same parser, launcher
    and workers, forked from this process's forkserver instead of a new interpreter that
    imports torch and starts its own (about 5 s a run). ``env`` is set for the run only
    (the workers take the caller's environment at each launch)."""
    with pytest.MonkeyPatch.context() as m:
        for k, v in (env or {}).items():
            m.setenv(k, v)
        assert cli_main(["train", *args]) == 0


def one_line(r, code, *needles):
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def error_line(r) -> str:
    return next(ln for ln in r.stderr.splitlines() if ln.startswith("gradsync train: error:"))


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_flipped_byte_in_tensor_data_is_named_and_nothing_is_overwritten(tmp_path):
    out = tmp_path / "run"
    train_here(*TINY, "--steps", "4", "--checkpoint-every", "2", "--out", str(out))
    ckpt = out / "checkpoint.pt"
    weight = torch.load(ckpt, weights_only=False)["model"]["0.weight"]
    data = bytearray(ckpt.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x10  # one flipped bit inside the tensor's bytes
    ckpt.write_bytes(bytes(data))
    r = run_cli(*TINY, "--steps", "6", "--out", str(out))
    one_line(r, 2, "is corrupted", "tensor 'model/0.weight' does not match its checksum")
    assert ckpt.read_bytes() == bytes(data)  # the damaged file was not used, nor replaced


def test_nan_from_a_huge_learning_rate_stops_before_any_checkpoint(tmp_path, capfd):
    out = tmp_path / "run"
    r = cli_here("train", *TINY, "--lr", "1e6", "--clip", "0", "--warmup", "0", "--steps", "20",
                 "--checkpoint-every", "1", "--out", str(out), capfd=capfd)
    assert r.returncode == 1, r.stderr[-3000:]
    line = error_line(r)
    assert "non-finite" in line and "on rank(s) 0, 1" in line and "no checkpoint holds it" in line
    step = int(line.split(" at step ")[1].split()[0])
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["step"] == step - 1  # every good step was saved; the bad one never
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())
    verify(str(out / "checkpoint.pt"))
    assert not (out / "summary.json").exists()
    assert "continue from step" in r.stderr


def test_skip_step_drops_the_update_on_every_rank_and_takes_a_stale_lock(tmp_path):
    skipped, straight = tmp_path / "skipped", tmp_path / "straight"
    skipped.mkdir()
    (skipped / "gradsync.lock").write_text(json.dumps({"host": "elsewhere", "pid": 999999,
                                                       "since": 0}))
    args = [*TINY, "--steps", "5", "--on-nonfinite", "skip-step"]
    # rank 1's loss is NaN in step 3; every rank stops cleanly after step 3's checkpoint
    r = run_cli(*args, "--out", str(skipped), env={"GRADSYNC_FAULT": "1:2:nan,*:2:stop"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "took over the lock of a run that is no longer running (host elsewhere" in r.stdout
    assert "non-finite loss (nan) at step 3 on rank(s) 1: update skipped on every rank" in r.stdout
    train_here(*args, "--out", str(straight), env={"GRADSYNC_FAULT": "*:1:stop"})
    a = torch.load(skipped / "checkpoint.pt", weights_only=False)
    b = torch.load(straight / "checkpoint.pt", weights_only=False)
    assert (a["step"], b["step"]) == (3, 2)  # step 3 changed nothing: the same weights
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for i, st in a["optimizer"]["state"].items():
        assert torch.equal(st["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
    train_here(*args, "--out", str(skipped))  # and it continues
    summary = json.loads((skipped / "summary.json").read_text())  # valid JSON: no NaN token
    assert summary["skipped_steps"] == [3]
    rows = [json.loads(x) for x in (skipped / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in rows] == [False, False, True, False, False]
    assert rows[2]["loss"] is None  # NaN is written as null


@pytest.mark.parametrize("compress", ["int8", "powersgd:1"])
def test_skip_step_with_error_feedback_skips_only_the_bad_step(tmp_path, compress, capfd):
    """A compressor's residual carries one step into the next: a NaN step once poisoned
    it, and every later step was non-finite and skipped, silently training nothing."""
    out = tmp_path / "run"
    r = cli_here("train", *TINY, "--steps", "7", "--on-nonfinite", "skip-step", "--compress",
                 compress, "--out", str(out), env={"GRADSYNC_FAULT": "0:3:nan"}, capfd=capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == [4]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["grad_norm"]) for m in rows if not m["skipped"])


def test_out_is_a_file(tmp_path, capfd):
    f = tmp_path / "taken"
    f.write_text("not a run")
    one_line(cli_here("train", *TINY, "--out", str(f), capfd=capfd), 2,
             f"--out {f} is a file, not a directory")


def test_read_only_out_is_refused_before_any_worker_starts(tmp_path, capfd):
    with tmpfs(tmp_path / "ro", "size=4m") as mnt:
        out = mnt / "run"
        train_here(*TINY, "--steps", "2", "--out", str(out))
        before = (out / "checkpoint.pt").read_bytes()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=30)
        r = cli_here("train", *TINY, "--steps", "4", "--out", str(out), capfd=capfd)
        one_line(r, 2, f"--out {out} is not writable (read-only file system)")
        assert (out / "checkpoint.pt").read_bytes() == before


def test_full_disk_says_so_first_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                   capfd):
    wide = ["--model", "tests.train.factories:wide32"]
    with tmpfs(tmp_path / "small", "size=3m") as mnt:
        out = mnt / "run"
        # the preflight refuses this disk (a ~2 MiB save beside the previous one needs ~4 MiB);
        # told it has room, the launcher starts the run and its second save meets the full disk
        monkeypatch.setattr(guard, "free_space", lambda path: 1 << 40)
        code = cli_main(["train", *TINY, *wide, "--steps", "4", "--checkpoint-every", "2",
                         "--out", str(out)])
        monkeypatch.undo()
        err = capfd.readouterr().err
        assert code == 1, err[-3000:]
        first = next(ln for ln in err.splitlines() if ln.startswith("gradsync train: error:"))
        assert first.startswith("gradsync train: error: no space left on device while "
                                "writing the checkpoint"), first
        ckpt = out / "checkpoint.pt"
        verify(str(ckpt))
        assert torch.load(ckpt, weights_only=False)["step"] == 2
        assert not list(out.glob(".tmp-*"))
        # now the estimate says it cannot fit: refused before any worker starts
        r = cli_here("train", *TINY, *wide, "--steps", "4", "--checkpoint-every", "2",
                     "--out", str(out), capfd=capfd)
        one_line(r, 2, "free on its device, but a checkpoint needs about")
        assert torch.load(ckpt, weights_only=False)["step"] == 2


def test_second_run_on_a_locked_directory_is_refused(tmp_path):
    out = tmp_path / "run"
    check_run_dir(str(out))
    with RunLock(str(out)):
        r = run_cli(*TINY, "--out", str(out))
    one_line(r, 2, f"{out} is in use by another gradsync run", f"pid {os.getpid()}")
    assert not (out / "checkpoint.pt").exists()


def test_connect_watchdog_ends_a_hung_setup_with_a_message():
    code = ("import time; from gradsync.dist import connect_watchdog\n"
            "with connect_watchdog(0.5, 'process-group set-up (test)'):\n    time.sleep(60)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 75
    assert "process-group set-up (test) did not finish within 0.5 s" in r.stderr


def _drift_with_nan(out: str):
    from torch import nn

    from gradsync.errors import ReplicaMismatchError
    from gradsync.train.config.train_config import TrainConfig
    from gradsync.train.records.instrument import Instruments

    cfg = TrainConfig(steps=4, drift_every=2, out=out)
    inst = Instruments(cfg.resolved(), gs.rank(), gs.world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    inst.maybe_check_drift(2, module)  # identical and finite: ok
    with torch.no_grad():
        module.bias[1] = float("nan")  # the same NaN on every rank: replicas "agree"
    try:
        inst.maybe_check_drift(4, module)
    except ReplicaMismatchError as e:
        return {"error": str(e), "ok": inst.drift["ok"]}
    finally:
        inst.close()
    return {"error": None, "ok": inst.drift["ok"]}


def test_drift_check_reports_nan_parameters_as_drift(tmp_path):
    results = gs.spawn(_drift_with_nan, 2, str(tmp_path))
    for res in results:
        message = res["error"]
        assert message and "parameter 'bias' holds NaN or inf at step 4" in message
        assert res["ok"] is False
    assert json.loads((tmp_path / "drift.json").read_text())["ok"] is False
