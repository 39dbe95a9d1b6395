"""`gradsync train --sync diloco|streaming-diloco --compress ...`: the loop, checkpoints, resume.

DiLoCo with H = 1, an outer SGD of lr 1 and no momentum is synchronous data
parallelism (equal items per worker keep inner momentum linear in the average),
so its losses equal ``--sync exact``'s to 1e-12 in float64. A local-update or
compressed run stopped mid-interval and continued (per-worker replicas, inner
optimizer state, residuals in the checkpoint) ends bit-identical to one that
never stopped.
"""

import json

import pytest
import torch

import gradsync as gs
from gradsync.rundir import METRICS, SUMMARY, read_metrics

STEPS = 8


def _cfg(out, **kw):
    base = dict(workers=2, steps=STEPS, global_batch=12, micro_batch=2, lr=0.05, warmup=2,
                optimizer="sgd", out=str(out), clip=0.0, checkpoint_every=0, eval_every=0,
                drift_every=0, no_report=True, seed=0, timeout=60,
                model="tests.train.factories:tiny64", data="tests.train.factories:regression64")
    return gs.TrainConfig(**{**base, **kw})


def _losses(out):
    return [m["loss"] for m in read_metrics(str(out / METRICS))[0]]


def _model(out):
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


def test_diloco_every_step_with_plain_averaging_is_synchronous_sgd(tmp_path):
    gs.train(_cfg(tmp_path / "exact"))
    gs.train(_cfg(tmp_path / "local", sync="diloco", sync_every=1, outer_lr=1.0,
                  outer_momentum=0.0))
    gaps = [abs(a - b) for a, b in zip(_losses(tmp_path / "exact"), _losses(tmp_path / "local"))]
    assert len(gaps) == STEPS and max(gaps) <= 1e-12, gaps
    a, b = _model(tmp_path / "exact"), _model(tmp_path / "local")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-12
    for run in ("exact", "local"):  # --collectives auto (the default) on one host: native
        summary = json.loads((tmp_path / run / SUMMARY).read_text())
        assert summary["collectives"] == "native"


@pytest.mark.parametrize("flags", [
    {"sync": "diloco", "sync_every": 3},
    {"sync": "streaming-diloco", "sync_every": 4, "fragments": 2, "sync_delay": 1},
    {"compress": "int8", "probe_every": 2},
], ids=["diloco", "streaming", "int8"])
def test_stopped_mid_interval_and_continued_is_bit_identical(tmp_path, flags):
    gs.train(_cfg(tmp_path / "straight", **flags))
    stop = gs.FaultInjector().fail_at(None, 5, "stop")  # mid-interval for H = 3 and 4
    gs.train(_cfg(tmp_path / "resumed", **flags), faults=stop)
    gs.train(_cfg(tmp_path / "resumed", **flags))
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "resumed")
    a, b = _model(tmp_path / "straight"), _model(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = read_metrics(str(tmp_path / "resumed" / METRICS))[0]
    assert all(m.get("sent_bytes") is not None for m in last)  # the strategy counts its bytes
    if "compress" in flags:
        probed = [m for m in last if "grad_cosine" in m]
        assert probed and all(0.99 < m["grad_cosine"] <= 1.0 for m in probed)


@pytest.mark.parametrize("kw,message", [
    ({"sync": "diloco", "strategy": "zero2"}, "zero2 synchronises exactly: --sync diloco needs "
                                              "--strategy ddp"),
    ({"compress": "int8", "strategy": "zero1"}, "exactly: --compress int8 needs --strategy ddp"),
    ({"sync": "diloco", "compress": "powersgd:2"}, "pseudo-gradients"),
    ({"compress": "int8", "collectives": "ring"}, "do not combine"),
    ({"compress": "zstd"}, "unknown --compress"),
    ({"compress": "int8", "precision": "bf16"}, "--compress int8 and --precision bf16 do not"),
    ({"sync": "diloco", "precision": "bf16"}, "drop --precision"),
    ({"strategy": "zero3", "collectives": "ring"}, "hybrid"),
])
def test_bad_combinations_are_one_line_errors(tmp_path, kw, message):
    with pytest.raises(gs.UsageError, match=message):
        cfg = _cfg(tmp_path / "bad", **kw)
        gs.train(cfg)
