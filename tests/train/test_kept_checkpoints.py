"""Checkpoints kept (``--keep-last``, ``--keep-best``), early stopping, ``--resume-from``.

One float64 run on a learnable teacher (``factories.teacher64``: the held-out loss falls,
wobbles, levels off), zero2 so every kept unit has a shard directory, trained three ways:

* straight through (the reference): 30 steps, an evaluation every step, a checkpoint every
  5, ``--keep-last 2 --keep-best eval_loss --early-stop eval_loss:4:0.005`` -- it stops
  after step 28 (4 evaluations without an improvement of more than 0.005 since step 24);
* killed during step 27 (a worker SIGKILLed, the launcher restarts from the checkpoint of
  step 25, whose patience counter says 1): the same stop, the same kept units, bit for
  bit -- a counter that were not checkpointed would stop a step later;
* ``--resume-from REF/checkpoints/best`` (step 24) into a new directory: steps 25-28 equal
  the reference's, bit for bit, and it stops where the reference did.

The rest is in-process: the lists, the watch, the parsers and the one-line refusals.
"""

import json
import os

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.rundir import CHECKPOINT, KEPT, KEPT_INDEX
from gradsync.train.checkpoint import kept as kept_units
from gradsync.train.checkpoint.kept import Kept, resolve_ref
from gradsync.train.checkpoint.size import checkpoints_at_peak
from gradsync.train.checkpoint.unit import read_unit
from gradsync.train.step.monitor import Watch, parse_early_stop, parse_monitor
from tests.cli_in_process import cli_here

pytestmark = pytest.mark.timeout(300)

FLAGS = dict(workers=2, steps=30, global_batch=8, micro_batch=2, lr=0.1, warmup=1,
             schedule="constant", optimizer="sgd", strategy="zero2", checkpoint_every=5,
             eval_every=1, keep_last=2, keep_best="eval_loss", early_stop="eval_loss:4:0.005",
             no_report=True, timeout=60, drift_every=0,
             model="tests.train.factories:tiny64", data="tests.train.factories:teacher64")


def _train(out, **kw):
    return gs.train(gs.TrainConfig(**{**FLAGS, "out": str(out), **kw}))


def _metrics(out) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r for r in rows if "step" in r and "event" not in r}


def _model(path) -> dict:
    return torch.load(os.path.join(path, CHECKPOINT), weights_only=True)["model"]


def _same_model(a, b) -> None:
    ma, mb = _model(a), _model(b)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("kept") / "ref"
    summary = _train(out)
    return out, summary


def test_early_stop_and_the_kept_units(reference):
    out, s = reference
    assert s["early_stop"]["stopped_at"] == 28 and s["early_stop"]["best_step"] == 24
    assert s["steps"] == 30 and max(_metrics(out)) == 28  # stopped, with a checkpoint
    assert s["kept"]["best"]["step"] == 24 and s["kept"]["last"] == [25, 28]
    best_loss = min(r["eval_loss"] for r in _metrics(out).values())
    assert s["kept"]["best"]["value"] == best_loss == _metrics(out)[24]["eval_loss"]
    root = out / KEPT
    assert sorted(os.listdir(root)) == [KEPT_INDEX, "step-0000024", "step-0000025", "step-0000028"]
    for step in (24, 25, 28):  # each a whole unit: verified like a run's own, shards included
        header = read_unit(str(root / f"step-{step:07d}" / CHECKPOINT))
        assert header["step"] == step and header["optimizer_shards"]
    assert resolve_ref(str(root / "best"), "--x") == str(root / "step-0000024")
    assert resolve_ref(str(root / "last"), "--x") == str(root / "step-0000028")
    # the newest unit is checkpoint.pt itself, linked (no copy)
    assert os.stat(out / CHECKPOINT).st_ino == os.stat(root / "step-0000028" / CHECKPOINT).st_ino
    # the same command again: finished, because it stopped early under this --early-stop
    assert _train(out) is None
    # the best exports like any checkpoint (the names read through kept.json)
    from gradsync.train.checkpoint.export import export_run

    got = export_run(str(root / "best"), "torch", str(out.parent / "best-export"),
                     model="tests.train.factories:tiny64")
    assert got.step == 24 and got.weights.endswith("(master weights)")


def test_a_killed_run_keeps_and_stops_exactly_as_the_uninterrupted_one(reference, tmp_path):
    ref, s_ref = reference
    out = tmp_path / "killed"
    faults = gs.FaultInjector().fail_at(1, 27, "kill")  # the checkpoint of step 25: bad = 1
    s = gs.train(gs.TrainConfig(**{**FLAGS, "out": str(out), "max_restarts": 1}), faults=faults)
    with open(out / "metrics.jsonl") as f:
        restarts = [json.loads(line) for line in f if '"restart"' in line]
    assert [r["step"] for r in restarts] == [25]  # it did die, and continued from step 25
    assert s["early_stop"] == s_ref["early_stop"]
    assert s["kept"]["last"] == s_ref["kept"]["last"] and s["kept"]["best"] == s_ref["kept"]["best"]
    ours, theirs = _metrics(out), _metrics(ref)
    assert ours.keys() == theirs.keys()
    for step in ours:
        assert ours[step]["loss"] == theirs[step]["loss"]
        assert ours[step].get("eval_loss") == theirs[step].get("eval_loss")
    for name in ("step-0000024", "step-0000025", "step-0000028"):
        _same_model(out / KEPT / name, ref / KEPT / name)


def test_resume_from_the_best_continues_bit_identically(reference, tmp_path):
    ref, s_ref = reference
    out = tmp_path / "from-best"
    s = _train(out, resume_from=str(ref / KEPT / "best"))
    assert s["resumed_from"] == 24
    assert s["early_stop"] == s_ref["early_stop"]  # its patience state came with the unit
    ours, theirs = _metrics(out), _metrics(ref)
    assert sorted(ours) == [25, 26, 27, 28]
    for step in ours:
        for key in ("loss", "eval_loss", "grad_norm", "lr"):
            assert ours[step][key] == theirs[step][key], (step, key)
    _same_model(out, ref)  # the final checkpoint, bit for bit
    assert s["kept"]["best"] == s_ref["kept"]["best"]  # the best unit came with it
    _same_model(out / KEPT / "step-0000024", ref / KEPT / "step-0000024")
    assert os.listdir(ref / KEPT / "step-0000024")  # the source is left as it was
    # the same command again continues (here: finds it finished), it does not install again
    assert _train(out, resume_from=str(ref / KEPT / "best")) is None


def test_the_lists_and_the_watch():
    k = Kept(3)
    for step in (5, 10, 15, 20):
        k.last = k.after_save(step)
    assert k.last == [10, 15, 20] and Kept(0).after_save(5) == []
    assert Kept(1).after_save(7) == [7]
    w = Watch(parse_monitor("sign:max"), parse_early_stop("eval_loss:2:0.1"))
    assert w.observe(1, 1.0, {"sign": 0.5}).best
    v = w.observe(2, 0.95, {"sign": 0.5})  # a tie is no new best; 0.05 is no improvement
    assert not v.best and not v.stop
    v = w.observe(3, float("nan"), {"sign": 0.7})  # a NaN never improves
    assert v.best and v.stop and w.stopped == 3
    again = Watch(parse_monitor("sign:max"), parse_early_stop("eval_loss:2:0.1"))
    again.load_state_dict(w.state_dict())
    assert again.best == {"value": 0.7, "step": 3} and again.stopped == 3
    other = Watch(parse_monitor("sign:max"), parse_early_stop("eval_loss:5"))
    other.load_state_dict(w.state_dict())  # another patience: counts afresh, said so
    assert other.stopped is None and other.notes
    assert parse_monitor("eval_metrics/acc:max").name == "acc"
    nan = Watch(None, parse_early_stop("eval_loss:1"))
    assert nan.observe(1, float("nan"), None).stop  # never finite: stopped, and said so
    assert "never a finite value" in nan.stop_line()


def test_space_is_counted_for_every_kept_unit():
    cfg = gs.TrainConfig(keep_last=3, keep_best="eval_loss").resolved()
    assert checkpoints_at_peak(cfg) == 3 + 1 + 1  # the kept, and the new save beside them
    assert checkpoints_at_peak(gs.TrainConfig().resolved()) == 2
    assert checkpoints_at_peak(gs.TrainConfig(keep_best="eval_loss").resolved()) == 3


@pytest.mark.parametrize("kw,needle", [
    (dict(keep_best="eval_loss", eval_every=0), "--keep-best watches held-out evaluations"),
    (dict(early_stop="eval_loss"), "--early-stop takes NAME[:min|:max]:PATIENCE"),
    (dict(early_stop="eval_loss:0"), "PATIENCE must be >= 1"),
    (dict(keep_best="acc:up"), "--keep-best takes NAME[:min|:max]"),
    (dict(keep_best="acc:max", early_stop="acc:min:3"), "opposite directions"),
    (dict(early_stop="eval_loss:3", sync="diloco"), "does not combine with --sync diloco"),
    (dict(keep_last=-1), "--keep-last must be an integer >= 0"),
    (dict(resume_from="a", init_from="b"), "give one of them"),
])
def test_refused_in_one_line(kw, needle):
    with pytest.raises(UsageError, match=".*") as e:
        gs.TrainConfig(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_resume_from_refusals(reference, tmp_path, capfd):
    ref, _ = reference
    tiny = ["--model", "tests.train.factories:tiny64", "--data", "tests.train.factories:teacher64",
            "--global-batch", "8", "--micro-batch", "2", "--no-report", "--timeout", "60"]
    r = cli_here("train", *tiny, "--out", str(tmp_path / "b"), "--resume-from",
                 str(tmp_path / "nothing"), capfd=capfd)
    assert r.returncode == 2 and "--resume-from" in r.stderr and "no such file" in r.stderr
    r = cli_here("train", *tiny, "--out", str(ref), "--resume-from", str(ref / KEPT / "best"),
                 capfd=capfd)
    assert r.returncode == 2 and "is inside --out" in r.stderr
    r = cli_here("train", *tiny, "--out", str(tmp_path / "c"), "--resume-from", str(tmp_path),
                 capfd=capfd)
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_metric_the_data_lacks_is_one_line(tmp_path, capfd):
    r = cli_here("train", "--model", "tests.train.factories:tiny64", "--data",
                 "tests.train.factories:teacher64", "--global-batch", "8", "--micro-batch", "2",
                 "--steps", "2", "--no-report", "--timeout", "60", "--out", str(tmp_path / "m"),
                 "--keep-best", "accuracy:max", capfd=capfd)
    assert r.returncode == 2, r.stderr
    assert "--keep-best accuracy: the data has no metric 'accuracy'" in r.stderr
    assert "eval_loss, mae, sign" in r.stderr


def test_reconcile_brings_the_directory_back_to_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    (out / KEPT).mkdir(parents=True)
    (out / CHECKPOINT).write_bytes(b"x")
    for step in (3, 6, 9):  # 9: an attempt's later unit; 3 is kept, 6 the current one
        (out / KEPT / f"step-{step:07d}").mkdir()
        (out / KEPT / f"step-{step:07d}" / CHECKPOINT).write_bytes(b"x")
    assert kept_units.prune(str(out), set()) == []  # no index: not gradsync's to remove
    (out / KEPT / KEPT_INDEX).write_text("{}")
    last, best, notes = kept_units.reconcile(str(out), 6, None, [6], {"step": 3, "value": 1.0},
                                             "eval_loss:min")
    assert kept_units.units(str(out)) == [3, 6] and last == [6] and best["step"] == 3
    assert any("step 9" in n for n in notes)
    index = json.loads((out / KEPT / KEPT_INDEX).read_text())
    assert index["best"]["dir"] == "step-0000003"
    (out / KEPT / "step-0000003" / CHECKPOINT).unlink()
    os.rmdir(out / KEPT / "step-0000003")  # removed by hand: said, and no longer kept
    last, best, notes = kept_units.reconcile(str(out), 6, None, [6], {"step": 3, "value": 1.0},
                                             "eval_loss:min")
    assert best == {"step": 3, "value": 1.0} and any("are not in" in n for n in notes)
    index = json.loads((out / KEPT / KEPT_INDEX).read_text())
    assert index["best"]["dir"] is None  # its value still counts; there is no unit to name
    with pytest.raises(UsageError, match="names no best checkpoint here .its best, step 3"):
        resolve_ref(str(out / KEPT / "best"), "--resume-from")
