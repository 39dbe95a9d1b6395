"""`gradsync verify`: the two-layer tanh regressor on real processes, and the sampler audit."""

import os
import subprocess
import sys

from tests.cli_in_process import cli_here

CLI = [sys.executable, "-m", "gradsync.cli"]
WIDE = {**os.environ, "COLUMNS": "200"}  # rich wraps tables to the terminal width


def test_verify_reproduces_tanh_regressor_with_eight_workers():
    r = subprocess.run([*CLI, "verify"], capture_output=True, text=True, timeout=240, env=WIDE)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "0.00e+00" in out  # drift across replicas
    assert out.count("0.179049") == 2  # both final losses, as the NumPy reference reaches
    mean_of_means = float(out.split("average of means")[1].split("gap ")[1].split()[0])
    assert mean_of_means > 1e-6  # uneven shards: DDP's average of per-rank means is off
    assert "PASS" in out


def test_verify_fails_loudly_when_tolerance_cannot_be_met(capfd):
    r = cli_here("verify", "--workers", "2", "--steps", "5", "--n", "64", "--tolerance", "1e-30",
                 capfd=capfd)
    assert r.returncode == 1 and "FAIL" in r.stdout


def test_verify_sampler_audit(capfd):
    r = cli_here("verify", "--sampler", "--n", "103", "--workers", "4", capfd=capfd,
                 env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every index exactly once" in r.stdout


def test_verify_bad_input_exit_2(capfd):
    r = cli_here("verify", "--workers", "9", "--n", "4", capfd=capfd)
    assert r.returncode == 2 and "9 workers but only 4 samples" in r.stderr
