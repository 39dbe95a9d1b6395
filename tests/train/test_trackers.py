"""`--log tensorboard,csv,wandb,mlflow`: refusals before any worker, and the fan-out's rules.

What the trackers hold after a real run stopped every way a run stops (Ctrl-C,
SIGTERM, a worker failure and its restart), read back with each library's own
reader, is ``test_trackers_interrupted.py``.
"""

import os

import pytest

import gradsync as gs
from gradsync.cli import main
from gradsync.errors import UsageError
from gradsync.train.records.trackers.base import Outcome, Tracker
from gradsync.train.records.trackers.fanout import TrackedWriter

pytestmark = pytest.mark.timeout(240)


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
    def __init__(self, name, fail=False, cuts_back=True):
        self.name, self.fail, self.steps, self.outcome = name, fail, [], None
        self.cuts_back = cuts_back

    def log(self, step, values, record):
        if self.fail:
            raise OSError("disk full")
        self.steps.append((step, values))

    def close(self, outcome):
        self.outcome = outcome.status


def test_a_failing_tracker_is_dropped_and_the_run_goes_on():
    said, sink = [], _Sink()
    good, bad = _Fake("csv"), _Fake("tensorboard", fail=True)
    fan = TrackedWriter(sink, [("tensorboard", lambda: bad), ("csv", lambda: good)],
                        said.append)
    fan.write({"step": 1, "loss": 0.5, "skipped": False, "eval_metrics": {"acc": 0.25},
               "exposed_comm_s_by_rank": [0.1, 0.2], "unix_time": 1.0})
    fan.write({"event": "restart", "step": 1})
    fan.write({"step": 2, "loss": float("nan"), "lr": 0.1})
    fan.close(Outcome())
    assert len(sink.records) == 3 and sink.closed
    assert good.steps == [(1, {"loss": 0.5, "eval_metrics/acc": 0.25}), (2, {"lr": 0.1})]
    assert good.outcome == "finished" and bad.outcome == "failed"
    assert len(said) == 1 and "--log tensorboard" in said[0] and "disk full" in said[0]
    assert os.linesep not in said[0]


def test_a_tracker_that_cannot_cut_back_gets_only_what_a_checkpoint_holds():
    """W&B and MLflow get a step once a checkpoint holds it: a stopped attempt's steps after
    its last checkpoint are computed again by the resume, and must not be there twice."""
    live, final = _Fake("tensorboard"), _Fake("wandb", cuts_back=False)
    fan = TrackedWriter(_Sink(), [("tensorboard", lambda: live), ("wandb", lambda: final)],
                        print)
    for step in (1, 2, 3):
        fan.write({"step": step, "items": 8})
        if step == 2:
            fan.committed(2)
    fan.close(Outcome("killed", 2))
    assert [s for s, _ in live.steps] == [1, 2, 3] and [s for s, _ in final.steps] == [1, 2]
    assert final.outcome == live.outcome == "killed" and final.sent == 2
    final = _Fake("wandb", cuts_back=False)  # a finished run's last steps are final too
    fan = TrackedWriter(_Sink(), [("wandb", lambda: final)], print)
    fan.write({"step": 1, "items": 8})
    fan.close(Outcome())
    assert [s for s, _ in final.steps] == [1] and Outcome().exit_code == 0
    assert Outcome("killed", 15).exit_code == 143 and Outcome("failed").exit_code == 1
