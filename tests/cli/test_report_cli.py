"""`gradsync report` on bad input, and on a run cut off midway; `--trace-steps` out of range.

No training here: a cut-off run is written by hand (config, two complete metrics
lines and a torn third, no summary), which is exactly what a crash mid-write
leaves behind.
"""

import json
import subprocess
import sys

from tests.cli_in_process import cli_here

CLI = [sys.executable, "-m", "gradsync.cli"]


def run_cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _one_line_usage_error(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_report_on_missing_path_is_one_line(tmp_path, capfd):
    _one_line_usage_error(cli_here("report", str(tmp_path / "nope"), capfd=capfd),
                          "not a directory")


def test_report_on_a_folder_that_is_not_a_run(tmp_path, capfd):
    (tmp_path / "notes.txt").write_text("hello")
    _one_line_usage_error(cli_here("report", str(tmp_path), capfd=capfd), "is not a gradsync run")
    assert not (tmp_path / "report.html").exists()


def test_report_on_a_cut_off_run_reports_what_exists(tmp_path):
    cfg = {"model": "gpt", "data": "pysrc", "steps": 10, "world_size": 2, "accumulation": 1,
           "micro_batch": 2, "global_batch": 4, "bucket_mb": 25.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rows = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": 0.05, "compute_s": 0.04,
             "exposed_comm_s": 0.01, "comm_bytes": 1000, "samples_per_s": 80.0,
             "peak_mem_mb_by_rank": [300.0, 310.0], "items": 128} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    r = run_cli("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "missing: the run stopped after step 2 of 10" in r.stdout
    assert "torn line" in r.stdout and "trace.json" in r.stdout
    page = (tmp_path / "report.html").read_text()
    assert "Missing from this run" in page and "stopped after step 2 of 10" in page
    assert "did not finish" in page
    for name in ("loss.png", "throughput.png", "step_breakdown.png", "memory.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "timeline.png").exists()  # nothing traced: no timeline, and said so


def test_trace_window_beyond_the_last_step_fails_before_launch(tmp_path, capfd):
    r = cli_here("train", "--steps", "6", "--trace-steps", "5:8", "--out", str(tmp_path / "r"),
                 capfd=capfd)
    _one_line_usage_error(r, "--trace-steps 5:8 goes beyond the last step (--steps 6)")
    assert not (tmp_path / "r").exists()
    r = cli_here("train", "--steps", "6", "--trace-steps", "x", "--out", str(tmp_path / "r"),
                 capfd=capfd)
    _one_line_usage_error(r, "--trace-steps must be FIRST:LAST")
