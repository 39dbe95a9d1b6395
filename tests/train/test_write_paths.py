"""Every write to a run directory fails in one line and leaves what was there; every read
of a damaged file goes on with a note (issue 23: D4, D6, a corrupt summary.json).

A full disk is real: a 200 KiB tmpfs, filled from outside while the run appends to
metrics.jsonl (the append that no longer fits must not leave half a line). An I/O
error cannot be produced for real, so it comes through the fault seam
(``GRADSYNC_FAULT=0:S:eio``: rank 0's metrics line of step S+1 fails halfway). The
same run directory then gets a byte that is not UTF-8 in metrics.jsonl (resume
and the report drop that line with a note) and a corrupt summary.json (the report
says so and rebuilds it; the "already finished" path rewrites it).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from gradsync.cli import main as cli_main
from gradsync.rundir import METRICS, SUMMARY, read_metrics_file
from tests.train.test_guards import ROOT, TINY, error_line, run_cli, tmpfs

QUIET = [*TINY, "--drift-every", "0"]


def _whole_lines(path) -> list[int]:
    """The steps of metrics.jsonl, asserting every line is whole, UTF-8 and JSON."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), raw[-200:]
    return [json.loads(line.decode())["step"] for line in raw.splitlines()]


def test_full_disk_while_appending_metrics_is_one_line_and_leaves_no_torn_line(tmp_path):
    with tmpfs(tmp_path / "small", "size=200k") as mnt:
        out = mnt / "run"
        cmd = [sys.executable, "-m", "gradsync.cli", "train", *QUIET, "--steps", "2000",
               "--checkpoint-every", "100000", "--out", str(out)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ})
        try:
            metrics, deadline = out / METRICS, time.time() + 90
            while not (metrics.exists() and metrics.read_bytes().count(b"\n") >= 3):
                assert proc.poll() is None and time.time() < deadline, proc.communicate()
                time.sleep(0.02)
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
            try:  # fill what is left: the next line that needs a new page cannot be written
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
            _, stderr = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        line = error_line(subprocess.CompletedProcess([], 1, "", stderr))
        assert line.startswith(f"gradsync train: error: no space left on device while writing "
                               f"metrics to {metrics} (step "), line
        assert "not recorded; the lines before it are intact" in line
        steps = _whole_lines(metrics)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
        assert "the same command starts again" in stderr.splitlines()[-1]


def test_io_error_then_a_damaged_line_then_a_corrupt_summary(tmp_path, capfd):
    out = tmp_path / "run"
    args = [*QUIET, "--steps", "6", "--checkpoint-every", "2", "--out", str(out)]
    r = run_cli(*args, env={"GRADSYNC_FAULT": "0:2:eio"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert error_line(r) == (f"gradsync train: error: input/output error (the disk or its file "
                             f"system failed) while writing metrics to {out / METRICS} (step 3 "
                             "not recorded; the lines before it are intact) (worker rank 0)")
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"gradsync train: the last complete checkpoint ({out / 'checkpoint.pt'}, step 2) is "
        "intact; once the cause is fixed, continue from step 2 with: gradsync train ")
    assert _whole_lines(out / METRICS) == [1, 2]  # the half-written line 3 was cut off

    # D6: a byte that is not UTF-8 in the middle of metrics.jsonl
    raw = (out / METRICS).read_bytes().splitlines(keepends=True)
    (out / METRICS).write_bytes(raw[0] + b'{"step": 1\xff}\n' + raw[1])
    assert "not UTF-8" in read_metrics_file(str(out / METRICS)).dropped[0]
    r = run_cli(*args)  # rank 0 repairs it and says so: its line is the worker's
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (f"gradsync train: {out / METRICS}: dropped 1 damaged line(s) (line 2: not UTF-8 "
            "(byte 0xff at column 11)) and rewrote it without them") in r.stdout
    assert _whole_lines(out / METRICS) == list(range(1, 7))  # rewritten consistently

    # a corrupt summary.json of a finished run: the report says so, not "did not finish"
    (out / SUMMARY).write_bytes(b'{"model": "tests.train\xfe')
    (out / METRICS).write_bytes((out / METRICS).read_bytes() + b"\x80\x81 torn")
    capfd.readouterr()
    assert cli_main(["report", str(out)]) == 0
    said = capfd.readouterr().out
    assert "did not finish" not in said and "Traceback" not in said
    assert (f"gradsync report: missing: {SUMMARY} is corrupt (byte 0xfe at offset 22 is not "
            "UTF-8), but the run finished (metrics.jsonl reaches step 6 of 6): this report "
            "rebuilt it from metrics.jsonl and config.json") in said
    assert "1 damaged line(s) skipped (line 7: a torn line (cut off mid-write))" in said
    html = (out / "report.html").read_text()
    assert "finished (summary.json rebuilt from metrics)" in html

    # the fix the report names: the run's own command (no worker starts: it is finished)
    assert cli_main(["train", *args]) == 0
    assert (f"gradsync train: {SUMMARY} was corrupt (byte 0xfe at offset 22 is not UTF-8); "
            "rewrote it from metrics.jsonl and config.json") in capfd.readouterr().out
    assert json.loads((out / SUMMARY).read_text())["final_loss"] is not None


def test_report_on_a_full_disk_keeps_the_old_report_and_says_the_command(tmp_path, capsys,
                                                                           monkeypatch):
    import errno

    from gradsync import runfiles

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"steps": 2, "trace": False, "drift_every": 0}))
    (out / METRICS).write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                       for s in (1, 2)))
    (out / "report.html").write_text("the previous report")
    real = os.fsync

    def full(fd):
        real(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runfiles.os, "fsync", full)
    capsys.readouterr()
    assert cli_main(["report", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradsync report: error: no space left on device "
                                               "while writing "), err
    assert err[0].endswith(f"once that is fixed, run again: gradsync report {out}"), err
    assert (out / "report.html").read_text() == "the previous report"
    assert not list(out.glob(".tmp-*"))


def meta_model():
    """A model built on the meta device and returned as it is (a shape, no values)."""
    import torch
    from torch import nn

    with torch.device("meta"):
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_a_parameter_on_the_meta_device_is_named(tmp_path):
    """Each worker builds its task first: the error names the parameter there, instead of
    torch's "Cannot copy out of meta tensor; no data!" when the strategy moves it."""
    import gradsync as gs
    from gradsync.train.task.build import build_task

    cfg = gs.TrainConfig(workers=2, steps=2, global_batch=12, micro_batch=2, out=str(tmp_path),
                         optimizer="sgd", model="tests.train.test_write_paths:meta_model",
                         data="tests.train.factories:regression32")
    with pytest.raises(gs.UsageError, match=r"--model tests.train.test_write_paths:meta_model: "
                                            r"parameter '0\.weight' \(and 3 more\) is on the "
                                            r"meta device \(a shape, no values\)"):
        build_task(cfg.resolved())


def test_diloco_on_another_number_of_workers_gives_the_command(tmp_path, capsys, monkeypatch):
    """Refused before any worker starts, with the command that continues the run."""
    from gradsync.train.checkpoint import state
    from gradsync.train.config import plan

    out = tmp_path / "run"  # a checkpoint of 2 workers, as the decision reads it
    monkeypatch.setattr(plan, "decide", lambda cfg, header: state.ResumePlan("resume", 4, 2,
                                                                             (2,)))
    argv = ["train", "--sync", "diloco", "--sync-every", "2", *QUIET, "--workers", "3",
            "--steps", "8", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["gradsync", *argv])
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"gradsync train: error: {out} holds a --sync diloco run of 2 workers, which continues "
        "on 2 only"), err
    assert err[0].endswith(" --steps 8 --out " + str(out) + " --workers 2"), err
    assert "--workers 3" not in err[0]
