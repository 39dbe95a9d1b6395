"""`--log tensorboard,csv,wandb,mlflow`: the metrics through each library's own writer.

One real run (two workers, gloo) with all four trackers, whose rank 0 fails during
step 4 and is restarted from the step-2 checkpoint (``--max-restarts 1``): every
tracker is opened twice, closed once on the failure and once at the end, and must
hold every step once, with metrics.jsonl's values. Each is read back with its own
library's reader: tensorboard's EventAccumulator, the csv module, MLflow's client
on the file store, and W&B's offline ``.wandb`` log (leveldb-style records of
wandb's protobuf messages) through ``wandb.proto``.
"""

import csv
import glob
import json
import os
import struct

import pytest

import gradsync as gs
from gradsync.cli import main
from gradsync.errors import UsageError
from gradsync.rundir import METRICS, METRICS_CSV, TRACKERS, read_metrics_file
from gradsync.train.records.trackers.base import Tracker
from gradsync.train.records.trackers.fanout import TrackedWriter

pytestmark = pytest.mark.timeout(240)
LOG = "tensorboard,csv,wandb,mlflow"
STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    for pkg in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(pkg)
    base = tmp_path_factory.mktemp("trackers")
    mp = pytest.MonkeyPatch()
    try:
        for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI",
                    "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(var, raising=False)
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(base / "wandb-home"))  # nothing written to the user's home
        out = base / "run"
        gs.train(gs.TrainConfig(
            workers=2, steps=STEPS, global_batch=8, micro_batch=2, lr=0.05, warmup=2,
            optimizer="sgd", out=str(out), checkpoint_every=2, eval_every=2, drift_every=0,
            no_report=True, timeout=60, max_restarts=1, log=LOG,
            model="tests.train.factories:tiny64", data="tests.train.factories:regression64"),
            faults=gs.FaultInjector().fail_at(0, 4, "raise"))
    finally:
        mp.undo()
    metrics = read_metrics_file(str(out / METRICS))
    assert [e["step"] for e in metrics.events] == [2]  # one restart, from the checkpoint
    assert [r["step"] for r in metrics.records] == list(range(1, STEPS + 1))
    return out, {r["step"]: r for r in metrics.records}


def _column(records: dict, key: str) -> list[tuple[int, float]]:
    return [(s, r[key]) for s, r in sorted(records.items()) if r.get(key) is not None]


def test_tensorboard_event_files_hold_each_step_once(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = run
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()  # the restart's purge_step hides what the failed attempt logged after step 2
    assert len(glob.glob(str(out / "tb" / "events.out.tfevents.*"))) == 2  # one per attempt
    for key in ("loss", "lr", "eval_loss", "grad_norm", "samples_per_s"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = _column(records, key)
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    assert [e.step for e in acc.Scalars("eval_loss")] == [2, 4, 6]


def test_csv_matches_metrics_jsonl(run):
    out, records = run
    with open(out / METRICS_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        rec = records[int(row["step"])]
        assert float(row["loss"]) == rec["loss"] and float(row["lr"]) == rec["lr"]
        assert row["eval_loss"] == ("" if "eval_loss" not in rec else repr(rec["eval_loss"]))
        assert int(row["items"]) == rec["items"] and row["skipped"] == "0"


def _wandb_records(path: str):
    """The protobuf records of a W&B offline log: a 7-byte header, then 32 KiB blocks of
    chunks (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield rec
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 0 and length == 0:
            pos += block - pos % block


def test_wandb_offline_run_continues_with_the_same_id(run):
    out, records = run
    run_id = json.loads((out / TRACKERS).read_text())["wandb"]["run_id"]
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    steps, exits = [], []
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                assert rec.run.run_id == run_id and rec.run.project == "gradsync"
            elif kind == "exit":
                exits.append(rec.exit.exit_code)
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in rec.history.item}
                steps.append(row["_step"])
                assert row["loss"] == records[row["_step"]]["loss"]
    assert steps == list(range(1, STEPS + 1))  # step 3 of the failed attempt is not sent again
    assert exits == [1, 0]


def test_mlflow_file_store_run_is_resumed(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store opt-in
    out, records = run
    saved = json.loads((out / TRACKERS).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("gradsync")
    assert len(client.search_runs([exp.experiment_id])) == 1
    r = client.get_run(saved["run_id"])
    assert r.info.status == "FINISHED" and r.data.params["lr"] == "0.05"
    for key in ("loss", "eval_loss", "lr"):
        hist = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, key))
        assert hist == _column(records, key), key


def test_unknown_or_missing_trackers_are_refused_before_any_worker(monkeypatch, tmp_path,
                                                                   capsys):
    with pytest.raises(UsageError, match="choose from tensorboard, csv, wandb, mlflow"):
        gs.TrainConfig(log="csv,neptune")
    assert gs.TrainConfig(log=" CSV, csv ,tensorboard").log == "csv,tensorboard"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UsageError) as e:
        gs.TrainConfig(log="csv,wandb")
    assert str(e.value) == ("--log wandb needs the wandb package, which is not installed: "
                            "pip install 'gradsync[log]' (or pip install wandb)")
    assert main(["train", "--log", "wandb", "--out", str(tmp_path / "r")]) == 2
    assert "pip install 'gradsync[log]'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


class _Sink:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, rec):
        self.records.append(rec)

    def close(self):
        self.closed = True


class _Fake(Tracker):
    def __init__(self, name, fail=False):
        self.name, self.fail, self.steps, self.finished = name, fail, [], None

    def log(self, step, values, record):
        if self.fail:
            raise OSError("disk full")
        self.steps.append((step, values))

    def close(self, finished):
        self.finished = finished


def test_a_failing_tracker_is_dropped_and_the_run_goes_on():
    said, sink = [], _Sink()
    good, bad = _Fake("csv"), _Fake("tensorboard", fail=True)
    fan = TrackedWriter(sink, [bad, good], said.append, last_step=2)
    fan.write({"step": 1, "loss": 0.5, "skipped": False, "eval_metrics": {"acc": 0.25},
               "exposed_comm_s_by_rank": [0.1, 0.2], "unix_time": 1.0})
    fan.write({"event": "restart", "step": 1})
    fan.write({"step": 2, "loss": float("nan"), "lr": 0.1})
    fan.close()
    assert len(sink.records) == 3 and sink.closed
    assert good.steps == [(1, {"loss": 0.5, "eval_metrics/acc": 0.25}), (2, {"lr": 0.1})]
    assert good.finished is True and bad.finished is False
    assert len(said) == 1 and "--log tensorboard" in said[0] and "disk full" in said[0]
    assert os.linesep not in said[0]
