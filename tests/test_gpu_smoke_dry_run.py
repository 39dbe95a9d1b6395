"""``benchmarks/gpu_smoke.py --dry-run``: the GPU smoke run's whole plan on the CPU.

So the script a lent GPU will run is known to work before the GPU is there: every
mode trains, stops, resumes bitwise and (the exact ones) matches one process in
float64; the command's stop-and-continue equals one run; the timing runs torch's
DDP and FSDP2 beside gradsync's. gloo, 2 ranks, small sizes.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_smoke_plan_passes_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"),
                          "--dry-run", "--json", str(out)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    assert {"ddp", "zero1", "zero2", "zero3", "int8", "powersgd", "diloco",
            "streaming"} <= set(report["modes"])
    for name, row in report["modes"].items():
        assert row["error"] is None and row["resume_gap"] == 0.0, (name, row)
        assert 0.5 <= row["moved_vs_fp32"] <= 4.0, (name, row)  # it trained
    assert report["modes"]["zero3"]["reference_gap"] <= 1e-12
    assert report["command"]["resume"]["ok"] and report["command"]["refused"]["ok"]
    for kind in ("torch DDP", "gradsync DataParallel", "torch FSDP2", "gradsync zero3 (FSDP)"):
        assert len(report["timing_ms"][kind]) == 3 and min(report["timing_ms"][kind]) > 0
    assert "all checks passed" in res.stdout
