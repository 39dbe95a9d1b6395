"""A SIGKILLed `gradsync train` launcher takes its workers with it (``lifeline.py``).

Without that, the workers are re-parented and keep training into the run
directory, whose lock died with the launcher: a rerun takes the lock over and two
jobs write one directory.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(180)
def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradsync.cli", "train", "--model", "mlp", "--steps", "100000",
           "--global-batch", "4", "--micro-batch", "2", "--checkpoint-every", "0",
           "--eval-every", "0", "--no-report", "--timeout", "60", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            cwd=tmp_path, start_new_session=True)
    metrics = out / "metrics.jsonl"
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, "the run ended before the kill"
            assert time.monotonic() < deadline, "no training steps within 120 s"
            time.sleep(0.2)
        below = _descendants(proc.pid)
        assert len(below) >= 2, below  # at least the workers (and the forkserver)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while [p for p in below if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in below if _alive(p)]
        steps = len(metrics.read_text().splitlines())
        time.sleep(1.0)
        assert not left, f"processes outlived the launcher: {left}"
        assert len(metrics.read_text().splitlines()) == steps, "training went on"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in below | _descendants(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
