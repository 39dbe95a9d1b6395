"""``gradsync eval``: a checkpoint scored on the held-out set equals the run's own score.

The claim, bit for bit: on the run's workers, the held-out loss (and the metrics) of a
checkpoint equal the ``eval_loss`` the run recorded at that step -- for ddp in float64
(also of a kept checkpoint, ``RUN/checkpoints/best``), zero2 and zero3 in bf16 (the model's
bf16 values, not the fp32 masters, are what the run's forward computed with). On another
number of workers the same mean, summed in another order: equal to float rounding.
"""

import json

import pytest

import gradsync as gs
from tests.cli_in_process import cli_here

pytestmark = pytest.mark.timeout(300)
F = "tests.train.factories:"
RUNS = {  # name -> (model, data, strategy, precision)
    "ddp": ("tiny64", "teacher64", "ddp", "fp32"),
    "zero2": ("tiny32", "teacher32", "zero2", "bf16"),
    "zero3": ("tiny32", "teacher32", "zero3", "bf16"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (model, data, strategy, precision) in RUNS.items():
        run = tmp_path_factory.mktemp(name) / "run"
        gs.train(gs.TrainConfig(
            workers=2, steps=4, global_batch=8, micro_batch=2, lr=0.05, warmup=1,
            optimizer="adamw", strategy=strategy, precision=precision, out=str(run),
            checkpoint_every=0, eval_every=1 if name == "ddp" else 4, drift_every=0,
            keep_best="mae" if name == "ddp" else "", no_report=True, timeout=60,
            model=F + model, data=F + data))
        out[name] = run
    return out


def _final(run):
    return json.loads((run / "summary.json").read_text())["final_eval_loss"]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_score_is_the_runs_own_bit_for_bit(runs, name):
    model, data, *_ = RUNS[name]
    r = gs.evaluate(str(runs[name]), model=F + model, data=F + data)
    assert r.step == 4 and r.workers == 2 and r.eval_loss == _final(runs[name])
    assert r.matches is True
    last = [json.loads(line) for line in open(runs[name] / "metrics.jsonl")][-1]
    assert r.eval_metrics == last["eval_metrics"]  # the user's metrics too


def test_a_kept_checkpoint_and_another_number_of_workers(runs, capfd):
    run = runs["ddp"]
    rows = {r["step"]: r for r in map(json.loads, open(run / "metrics.jsonl"))}
    best = json.loads((run / "checkpoints" / "kept.json").read_text())["best"]
    r = cli_here("eval", str(run / "checkpoints" / "best"), "--model", F + "tiny64", "--data",
                 F + "teacher64", "--json", capfd=capfd)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["step"] == best["step"] and got["eval_loss"] == rows[best["step"]]["eval_loss"]
    assert got["eval_metrics"]["mae"] == best["value"] and got["matches"] is True
    r = cli_here("eval", str(run), "--model", F + "tiny64", "--data", F + "teacher64",
                 "--workers", "1", capfd=capfd)
    assert r.returncode == 0, r.stderr
    loss = float(next(ln for ln in r.stdout.splitlines() if ln.startswith("eval_loss")).split()[1])
    assert loss == pytest.approx(_final(run), rel=1e-13, abs=0)
    assert "summed in another order" in r.stdout or "bit for bit" in r.stdout


def test_refusals_are_one_line(runs, tmp_path, capfd):
    run = runs["ddp"]
    cases = [
        ((str(run),), "which gradsync eval imports only when the command line names it"),
        ((str(run), "--model", F + "tiny64"), "pass --data tests.train.factories:teacher64"),
        ((str(tmp_path / "none"),), "no such file or directory"),
        ((str(runs["zero2"] / "checkpoints" / "best"),), "keeps no checkpoint besides its newest"),
        ((str(run), "--model", F + "tiny64", "--data", F + "regression32"),
         "has no held-out set"),
        ((str(run), "--model", F + "tiny32", "--data", F + "teacher64"),
         "does not fit the model built for it"),
    ]
    for args, needle in cases:
        r = cli_here("eval", *args, capfd=capfd)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
