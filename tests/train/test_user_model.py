"""The user's own model and data: from the CLI (module:factory) and from Python (gs.train).

* ``gradsync train --model pkg:factory --data pkg:factory`` trains, fails, is
  continued by the same command, evaluates the held-out set exactly (the same
  number one process gets on the whole held-out set), and reports.
* A Strategy subclass registered under a new name plugs into the loop with no
  change to it: its ``after_step`` hook runs once per update, and its
  ``extra_state`` survives a stop and a resume (through ``checkpoint.pt``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gradsync as gs
from gradsync.cli import main as cli_main
from gradsync.engine.strategy.exact import DataParallelStrategy
from gradsync.engine.strategy.registry import STRATEGIES, register_strategy
from tests.cli_in_process import cli_here
from tests.train.factories import tensors, tiny64

ROOT = Path(__file__).resolve().parents[2]
USER = ["--model", "tests.train.factories:tiny64", "--data", "tests.train.factories:regression64",
        "--global-batch", "12", "--micro-batch", "3", "--steps", "6", "--checkpoint-every", "2",
        "--eval-every", "2", "--timeout", "60"]


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *args],
                          capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_user_model_and_data_train_resume_and_report(tmp_path, capfd):
    out = tmp_path / "run"
    r = cli_here("train", *USER, "--out", str(out), env={"GRADSYNC_FAULT": "0:3:raise"},
                 capfd=capfd)
    assert r.returncode == 1
    assert "continue from step 2 with: gradsync train --model tests.train.factories:tiny64" \
        in r.stderr
    r = run_cli(*USER, "--out", str(out))  # the same command: resuming is automatic
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 2 of 6 (2 workers, was 2)" in r.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]  # cut back to the checkpoint
    assert [m["step"] for m in rows if "eval_loss" in m] == [2, 4, 6]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tests.train.factories:tiny64" and summary["optimizer"] == "adamw"
    # the held-out loss is exact: one process, the final weights, the whole held-out set
    torch.manual_seed(0)
    model = tiny64()
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=False)["model"])
    hx, hy = tensors(10, seed=2)
    with torch.no_grad():
        assert abs(F.mse_loss(model(hx), hy).item() - summary["final_eval_loss"]) <= 1e-12
    page = (out / "report.html").read_text()
    assert "held-out" in page and "Missing from this run" not in page  # no trace was asked for
    assert "ddp / fp64 / adamw" in page and (out / "loss.png").exists()


class CountingStrategy(DataParallelStrategy):
    """Exact DDP that counts its updates: the smallest user of the extension points."""

    def __init__(self, *args):
        super().__init__(*args)
        self.updates, self.items = 0, 0

    def after_step(self, num_items: int) -> None:
        self.updates += 1
        self.items += num_items

    def extra_state(self) -> dict:
        return {"updates": self.updates, "items": self.items}

    def load_extra_state(self, state: dict) -> None:
        self.updates, self.items = state["updates"], state["items"]


def _build_counting(module, precision, optimizer_class, bucket_cap_mb, wrap, group, **kw):
    ddp = STRATEGIES["ddp"](module, precision, optimizer_class, bucket_cap_mb, wrap, group, **kw)
    return CountingStrategy("counting", precision, ddp.model, ddp.optimizer)


def _counting_worker(out: str):
    register_strategy("counting", _build_counting)
    cfg = gs.TrainConfig(strategy="counting", steps=5, global_batch=12, micro_batch=2,
                         out=out, eval_every=0, no_report=True, checkpoint_every=0,
                         model="tests.train.factories:tiny64",
                         data="tests.train.factories:regression64")
    first = gs.train(cfg, faults=gs.FaultInjector().fail_at(None, 2, "stop"))
    extra = None
    if gs.rank() == 0:  # the writer; the others may already be past the save
        extra = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
        extra = extra["strategy_extra"]
    second = gs.train(cfg)
    return {"stopped_run": first, "extra_at_stop": extra, "resumed_run": second}


def test_a_registered_strategy_plugs_in_with_its_hook_and_extra_state(tmp_path):
    out = str(tmp_path / "run")
    results = gs.spawn(_counting_worker, 2, out)
    first, after_stop, summary = (results[0][k] for k in ("stopped_run", "extra_at_stop",
                                                          "resumed_run"))
    assert first is None and after_stop == {"updates": 2, "items": 24}
    assert summary["strategy"] == "counting" and summary["resumed_from"] == 2
    final = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert final["strategy_extra"] == {"updates": 5, "items": 60}
    assert results[1]["resumed_run"] is None  # rank 1 returns no summary


def test_the_example_factories_train(tmp_path, capfd):
    r = cli_here("train", "--model", "examples.user_model:build_model", "--data",
                 "examples.user_model:build_data", "--steps", "3", "--eval-every", "3",
                 "--no-report", "--out", str(tmp_path / "run"), capfd=capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_eval_loss"] is not None and summary["optimizer"] == "adamw"


def test_a_dict_sample_without_labels_is_a_one_line_error(tmp_path):
    r = run_cli("--model", "tests.train.factories:padded_lm", "--data",
                "tests.train.factories:dict_samples", "--steps", "2", "--out",
                str(tmp_path / "run"))
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert "a training sample is a dict with keys ['input_ids', 'targets'] and no 'labels'" \
        in err[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_model_that_skips_a_layer_needs_find_unused_parameters(tmp_path, strategy, capfd):
    """Without the flag: one line naming the parameter and the flag, no traceback; with
    it: trains, and the skipped layer is never stepped (AdamW would move it)."""
    args = ["--model", "tests.train.factories:skips_a_layer", "--data",
            "tests.train.factories:regression64", "--optimizer", "adamw", "--global-batch", "12",
            "--micro-batch", "3", "--steps", "3", "--eval-every", "0", "--timeout", "60",
            "--no-report", "--strategy", strategy]
    # ddp as a real command, whose stderr includes the workers' (no traceback there
    # either); the sharded strategies in this process
    r = (run_cli(*args, "--out", str(tmp_path / "refused")) if strategy == "ddp" else
         cli_here("train", *args, "--out", str(tmp_path / "refused"), capfd=capfd))
    assert r.returncode == 1
    assert "'unused.weight'" in r.stderr and "--find-unused-parameters" in r.stderr
    assert "Traceback" not in r.stderr
    assert "once the cause is fixed, the same command starts again" in r.stderr
    # with the flag: through gradsync.cli.main in this process (its output is not read;
    # its workers fork from this process's forkserver: ~5 s less than a new interpreter)
    assert cli_main(["train", *args, "--find-unused-parameters", "--out", str(tmp_path / "ok")]) \
        == 0
    from tests.train.factories import skips_a_layer

    torch.manual_seed(0)
    fresh = skips_a_layer().state_dict()
    saved = torch.load(tmp_path / "ok" / "checkpoint.pt", weights_only=False)["model"]
    assert torch.equal(saved["unused.weight"], fresh["unused.weight"])
    assert not torch.equal(saved["body.0.weight"], fresh["body.0.weight"])
