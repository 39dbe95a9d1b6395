"""Issue 34, defect 6 (report): junk in a run directory is a note, never a traceback.

A run directory may come from someone else, or another tool may have written lines
into its ``metrics.jsonl``. At 4ab900c ``gradsync report`` on this run raised KeyError
on a line ``{"epoch": 1}``, TypeError on ``{"step": "seven"}``, ``{"items": "many"}`` or
a per-rank list holding a string, ValueError on ``{"step": 1.5}``; a ``summary.json``
or ``trace.json`` of the wrong shape crashed it too. Now every record is checked
against the kinds its schema declares (``rundir.record_problem``, ``Summary.problem``),
a line that does not fit is dropped with a note naming it, and a trace that cannot
be read is listed as missing.
The run is written by hand, as in ``tests/cli/test_report_cli.py``: no training.
"""

import json

import pytest

from gradsync.rundir import read_metrics_file, record_problem
from tests.cli_in_process import cli_here

CONFIG = {"model": "gpt", "data": "pysrc", "steps": 2, "world_size": 2, "accumulation": 1,
          "micro_batch": 2, "global_batch": 4, "bucket_mb": 25.0}
ROWS = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": 0.05, "compute_s": 0.04,
         "exposed_comm_s": 0.01, "comm_bytes": 1000, "samples_per_s": 80.0,
         "peak_mem_mb_by_rank": [300.0, 310.0], "items": 128, "world_size": 2} for s in (1, 2)]
SUMMARY = {"steps": 2, "world_size": 2, "median_step_s": 0.05, "optimizer": "sgd"}


def _run(path, extra_lines=(), summary=SUMMARY, trace=None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    lines = [json.dumps(r) for r in ROWS] + list(extra_lines)
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if trace is not None:
        (path / "trace.json").write_text(json.dumps(trace))
    return path


def _reported(r) -> list[str]:
    assert r.returncode == 0 and "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    return [ln for ln in r.stdout.splitlines() if ln.startswith("gradsync report: missing: ")]


JUNK = {  # a line of metrics.jsonl -> what the note says about it
    '{"epoch": 1}': "not a step record (it has no 'step')",
    '{"step": "seven"}': "not a step record (its 'step' is 'seven', not a step number)",
    '{"step": 1.5}': "not a step record (its 'step' is 1.5, not a step number)",
    '{"step": true}': "not a step record (its 'step' is True, not a step number)",
    '{"step": 3, "items": "many"}': "its 'items' is 'many', not a whole number",
    '{"step": 3, "loss": [1]}': "its 'loss' is [1], not a number",
    '{"step": 3, "peak_mem_mb_by_rank": "a"}':
        "its 'peak_mem_mb_by_rank' is 'a', not a list of numbers",
    '{"step": 3, "world_size": "two"}': "its 'world_size' is 'two', not a whole number",
    '{"step": 3, "grad_norm": {"a": 1}}': "its 'grad_norm' is {'a': 1}, not a number",
    '{"event": "restart", "failed": [1, "a"]}':
        "its 'failed' is [1, 'a'], not a list of failures by rank",
    '{"event": 5}': "its 'event' is 5, not a string",
}


@pytest.mark.parametrize("line", list(JUNK))
def test_a_junk_metrics_line_is_a_note_naming_it(tmp_path, capfd, line):
    run = _run(tmp_path / "run", [line])
    missing = _reported(cli_here("report", str(run), capfd=capfd))
    note = f"metrics.jsonl: 1 damaged line(s) skipped (line 3: {JUNK[line]})"
    assert any(note in m for m in missing), missing
    assert not any("stopped after" in m for m in missing), missing
    assert (run / "report.html").exists()


def test_gradsyncs_own_records_pass_the_check(tmp_path):
    """What train writes (nulls for non-finite numbers included) is never dropped."""
    run = _run(tmp_path / "run", ['{"step": 3, "loss": null, "grad_norm": null, "lr": 0.1}',
                                  '{"event": "restart", "step": 2, "attempt": 1, "failed": '
                                  '[{"rank": 1, "how": "was killed", "exitcode": -9}]}'])
    m = read_metrics_file(str(run / "metrics.jsonl"))
    assert m.dropped == [] and len(m.records) == 3 and len(m.events) == 1
    assert all(record_problem(r) is None for r in ROWS)


def test_a_summary_of_the_wrong_shape_is_corrupt_not_a_crash(tmp_path, capfd):
    run = _run(tmp_path / "run", summary={**SUMMARY, "median_step_s": "fast", "memory": 5})
    missing = _reported(cli_here("report", str(run), capfd=capfd))
    assert any("summary.json is corrupt (its 'median_step_s' is 'fast', not a number), but "
               "the run finished" in m for m in missing), missing


def test_a_memory_table_of_the_wrong_shape_is_a_note(tmp_path, capfd):
    run = _run(tmp_path / "run", summary={**SUMMARY, "memory": {"params": "x", "stage": [1]}})
    _reported(cli_here("report", str(run), capfd=capfd))
    assert "memory table is not as gradsync writes it" in (run / "report.html").read_text()


def test_a_trace_of_the_wrong_shape_is_missing_not_a_crash(tmp_path, capfd):
    run = _run(tmp_path / "run", trace={"traceEvents": "none"})
    missing = _reported(cli_here("report", str(run), capfd=capfd))
    assert any("trace.json is not a trace gradsync wrote (AttributeError" in m
               for m in missing), missing
