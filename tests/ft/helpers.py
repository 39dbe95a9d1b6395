"""Shared by the fault-tolerance tests: the run command, the uninterrupted reference.

Every run is a real `gradsync train` (or torchrun) subprocess under a timeout, on
tests/train/factories.py's float64 tiny model and recorded regression data;
SGD with momentum, so a lost optimizer state or a skipped sample shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from gradsync.rundir import METRICS, read_metrics, read_metrics_file

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--model", "tests.train.factories:tiny64", "--data", "tests.train.factories:regression64",
         "--optimizer", "sgd", "--lr", "0.05", "--steps", "8", "--global-batch", "10",
         "--micro-batch", "2", "--checkpoint-every", "4", "--eval-every", "0", "--no-report",
         "--timeout", "60", "--drift-every", "0"]


def env(record: Path | None = None, **extra) -> dict:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT), **extra}
    if record is not None:
        out["GRADSYNC_TEST_RECORD"] = str(record)
    return out


def run_train(args, tmp: Path, timeout: float = 240, **extra):
    """`gradsync train TRAIN ARGS` with a fresh index-recording directory; (proc, record)."""
    record = tmp / f"record-{len(list(tmp.glob('record-*')))}"
    record.mkdir()
    proc = subprocess.run([sys.executable, "-m", "gradsync", "train", *TRAIN, *args],
                          capture_output=True, text=True, env=env(record, **extra), cwd=ROOT,
                          timeout=timeout)
    return proc, record


def recorded(record: Path) -> Counter:
    """Every dataset index any worker read, with multiplicity."""
    return Counter(int(x) for f in record.glob("*.txt") for x in f.read_text().split())


def straight_run(tmp: Path):
    """One uninterrupted run on the whole batch: (final model, indices read)."""
    proc, record = run_train(["--workers", "1", "--out", str(tmp / "run")], tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(tmp / "run" / "checkpoint.pt", weights_only=False)["model"], \
        recorded(record)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def final_model(run: Path, steps: int = 8) -> dict:
    """The run's last checkpoint's parameters, ``slow64``'s without its ``net.`` prefix (the
    same tiny64 behind a forward delay), so they compare with the straight run's."""
    final = torch.load(run / "checkpoint.pt", weights_only=False)
    assert final["step"] == steps
    return {k.removeprefix("net."): v for k, v in final["model"].items()}


SLOW = ["--model", "tests.train.factories:slow64"]
"""tiny64 whose every forward takes ``GRADSYNC_TEST_FORWARD_S``: steps of real length (two
forwards a step with ``--micro-batch 2``), the regime of issue 35."""


def membership(out: Path, groups: int, faults=()):
    """The job's steps as :mod:`gradsync.ft.membership` reads them, and its summary
    (``faults``: (group, unix time, link-down seconds))."""
    from gradsync.ft.membership import down_windows, job_steps, summary

    steps = job_steps(str(out), groups)
    return steps, summary(steps, groups, down_windows(str(out), groups, list(faults)))


def kill_times(run: Path) -> list[float]:
    """When the launcher saw this group's workers fail (its restart records, to the second)."""
    return [float(f["unix_time"]) for e in restarts(run) for f in e.get("failed", [])
            if f.get("unix_time")]


def step_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(str(run / METRICS))[0] if "loss" in r]


def restarts(run: Path) -> list[dict]:
    """The launcher's restarts of this group's workers, as recorded in its metrics."""
    return [e for e in read_metrics_file(str(run / METRICS)).events
            if e.get("event") == "restart"]
