"""`gradsync train --precision fp16`: the built-in GPT trains under every exact strategy,
loss scaling is reported, a stopped run continues bit for bit, and ``--on-nonfinite``
still sees what loss scaling does not explain.

The first steps of an fp16 run overflow while the scale backs off from 2**16 (the
loss a micro-batch contributes is its mean times its 128 tokens, so the scale that
fits is smaller than a per-token one): those steps are skipped and recorded, the
later ones train. A continued run must resume the scale where it was: restarted
at 2**16 it would skip its first steps again and part from the uninterrupted run.
"""

import json

import pytest
import torch

import gradsync as gs
from gradsync.rundir import METRICS, read_metrics
from gradsync.train.config.train_config import TrainConfig
from tests.cli_in_process import cli_here

GPT = ["--model", "gpt", "--seq-len", "32", "--micro-batch", "4", "--global-batch", "8",
       "--lr", "1e-3", "--eval-every", "0", "--drift-every", "0", "--no-report",
       "--timeout", "60"]
CFG = dict(model="gpt", data="pysrc", precision="fp16", steps=10, seq_len=32, global_batch=8,
           micro_batch=4, lr=1e-3, workers=2, checkpoint_every=0, eval_every=0, drift_every=0,
           no_report=True, timeout=60)


def _rows(out):
    return read_metrics(str(out / METRICS))[0]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_fp16_trains_the_gpt_and_reports_its_skipped_steps(tmp_path, strategy, capfd):
    out = tmp_path / "run"
    r = cli_here("train", *GPT, "--precision", "fp16", "--strategy", strategy, "--steps", "24",
                 "--out", str(out), capfd=capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    assert [m["step"] for m in rows] == list(range(1, 25))
    over = [bool(m.get("overflow")) for m in rows]
    k = over.index(False)  # the first steps overflow while the scale settles
    assert k >= 1 and rows[0]["loss_scale"] == 2.0 ** 16
    for m, nxt in zip(rows, rows[1:]):  # halved after each overflow, else kept (no growth
        assert nxt["loss_scale"] == m["loss_scale"] / (2 if m.get("overflow") else 1)  # in 24)
    for m in rows:  # a skipped step reports no norm; every other one a finite norm
        assert m["skipped"] == bool(m.get("overflow"))
        assert (m["grad_norm"] is None) == m["skipped"]
    first, last = rows[k]["loss"], sum(m["loss"] for m in rows[-4:]) / 4
    assert last < first - 0.5, (first, last)  # it trains
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "fp16" and summary["skipped_steps"] == []
    final = rows[-1]["loss_scale"] / (2 if over[-1] else 1)
    assert summary["loss_scale"] == {"skipped": sum(over), "scale": final}


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_stopped_fp16_run_continues_bit_for_bit(tmp_path, strategy):
    cfg = dict(CFG, strategy=strategy)
    gs.train(TrainConfig(out=str(tmp_path / "straight"), **cfg))
    broken = tmp_path / "broken"
    # stopped mid-way through the scale's backing off: step 4 ran at 2**13
    gs.train(TrainConfig(out=str(broken), **cfg), faults=gs.FaultInjector().fail_at(None, 4,
                                                                                     "stop"))
    assert _rows(broken)[-1]["step"] == 4 and _rows(broken)[-1].get("overflow")
    gs.train(TrainConfig(out=str(broken), **cfg))
    a, b = _rows(tmp_path / "straight"), _rows(broken)
    assert [m.get("overflow") for m in a] == [m.get("overflow") for m in b]
    assert [(m["loss"], m["loss_scale"]) for m in a] == [(m["loss"], m["loss_scale"]) for m in b]
    assert sum(1 for m in a if m.get("overflow")) >= 5  # the resumed part needed the scale
    ma = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    mb = torch.load(broken / "checkpoint.pt", weights_only=False)
    assert ma["strategy_extra"] == mb["strategy_extra"]  # the scale and its counters
    assert all(torch.equal(ma["model"][k], mb["model"][k]) for k in ma["model"])


def test_a_nan_loss_under_fp16_is_not_put_down_to_loss_scaling(tmp_path, capfd):
    """--on-nonfinite stop still stops on a NaN loss (rank 0, step 10, after the scale
    settled); skip-step skips it as non-finite, not as an overflow."""
    base = [*GPT, "--precision", "fp16", "--steps", "11"]
    r = cli_here("train", *base, "--out", str(tmp_path / "stop"),
                 env={"GRADSYNC_FAULT": "0:9:nan"}, capfd=capfd)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "non-finite loss (nan) at step 10 on rank(s) 0" in r.stderr
    out = tmp_path / "skip"
    r = cli_here("train", *base, "--on-nonfinite", "skip-step", "--out", str(out),
                 env={"GRADSYNC_FAULT": "0:9:nan"}, capfd=capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == [10]
    row = _rows(out)[9]
    assert row["skipped"] and not row.get("overflow")
    assert summary["loss_scale"]["skipped"] == sum(1 for m in _rows(out) if m.get("overflow"))


@pytest.mark.parametrize("flags,needle", [
    (["--ft-groups", "2"], "--precision fp16 does not combine with --ft-groups"),
    (["--compress", "int8"], "--compress int8 and --precision fp16 do not combine"),
    (["--sync", "diloco"], "--sync diloco trains in fp32")])
def test_what_fp16_does_not_combine_with_is_refused_in_one_line(tmp_path, flags, needle, capfd):
    r = cli_here("train", *GPT, "--precision", "fp16", *flags, "--out", str(tmp_path / "run"),
                 capfd=capfd)
    assert r.returncode == 2, r.stderr[-3000:]
    assert needle in r.stderr
