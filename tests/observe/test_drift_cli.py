"""A drifted replica stops `gradsync train` on every rank, and the report says so.

GRADSYNC_FAULT=1:1:perturb nudges rank 1's first parameter during step 2; the
drift check at step 2 (--drift-every 2) must stop the run there (no step 3),
naming the parameter and rank 1, record the failure in drift.json, and the
report written after the failure must show it.
"""

import json

from tests.cli_in_process import cli_here


def test_perturbed_replica_stops_training_with_the_parameter_and_rank(tmp_path, capfd):
    out = tmp_path / "run"
    r = cli_here("train", "--steps", "6", "--seq-len", "32", "--global-batch", "8",
                 "--micro-batch", "4", "--drift-every", "2", "--out", str(out), capfd=capfd,
                 env={"GRADSYNC_FAULT": "1:1:perturb"})
    assert r.returncode == 1, r.stdout + r.stderr
    # (torch may log a "Terminating process" warning first; ours is the error line)
    first = next(ln for ln in r.stderr.splitlines() if ln.startswith("gradsync train: error:"))
    assert "error: replicas drifted at step 2" in first  # one plain line, no type name
    assert "parameter 'tok_emb.weight' differs between rank 0 and rank(s) 1" in first
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # stopped at the check, on every rank
    drift = json.loads((out / "drift.json").read_text())
    assert drift["ok"] is False and drift["last_step"] == 2 and "rank(s) 1" in drift["error"]
    page = (out / "report.html").read_text()
    assert "Drift check FAILED at step 2" in page and "stopped after step 2 of 6" in page
