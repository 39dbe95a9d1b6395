"""The learning-rate schedule: linear warm-up, then cosine decay to 10% or constant."""

import argparse
import math

import pytest

from gradsync.train.config.flags import add_arguments, from_args
from gradsync.train.config.train_config import TrainConfig
from gradsync.train.task.schedule import lr_factor


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_cosine_warms_up_then_decays_to_a_tenth():
    cfg = TrainConfig(steps=10, warmup=2).resolved()
    f = [lr_factor(s, cfg) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == 1.0 and all(a > b for a, b in zip(f[2:], f[3:]))
    assert f[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_factor(10, cfg) == pytest.approx(0.1)  # the end of the planned span


def test_help_says_where_the_cosine_reaches_a_tenth():
    """Issue 37: --help said the cosine reaches 10% of --lr "at the last step"; a run's last
    step (1-based N, factor index N - 1) trains above it and step N + 1 at it. Decided: the
    schedule stays (torch's CosineAnnealingLR and transformers' cosine end the same way, and
    every run and checkpoint trains on it), the words say what it does."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = " ".join(p.format_help().split())  # as --help prints it
    text = text[text.index("--schedule {cosine,constant} after"):][:400]
    assert "at the last step" not in text
    assert "its last step trains just above 10%, every step after it at 10%" in text
    for steps, warmup in ((10, 2), (300, 20), (5, 0)):
        cfg = TrainConfig(steps=steps, warmup=warmup).resolved()
        assert lr_factor(steps - 1, cfg) > 0.1 + 1e-6  # the last planned step: above
        assert lr_factor(steps, cfg) == pytest.approx(0.1)  # the first past the plan: at it


def test_constant_holds_the_peak_after_warm_up():
    cfg = _parse("--steps", "10", "--warmup", "3", "--schedule", "constant")
    assert cfg.schedule == "constant"
    assert [lr_factor(s, cfg.resolved()) for s in range(10)] == pytest.approx(
        [1 / 3, 2 / 3, 1.0] + [1.0] * 7)
    assert _parse().schedule == "cosine"  # the default is unchanged


def test_unknown_schedule_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--schedule", "linear")
    assert e.value.code == 2 and "invalid choice: 'linear'" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_a_changed_lr_on_resume_is_followed_like_the_schedule(tmp_path):
    """The state dicts carry the old peak rate; the flags given now decide it (a changed
    --lr is refused unless --override lr says so: tests/train/test_resume_identity.py)."""
    import gradsync as gs
    from gradsync.rundir import METRICS, read_metrics

    base = dict(workers=2, global_batch=12, micro_batch=2, warmup=0, schedule="constant",
                optimizer="sgd", out=str(tmp_path / "run"), checkpoint_every=2, eval_every=0,
                drift_every=0, no_report=True, timeout=60,
                model="tests.train.factories:tiny64", data="tests.train.factories:regression64")
    gs.train(gs.TrainConfig(steps=2, lr=0.01, **base))
    gs.train(gs.TrainConfig(steps=4, lr=0.03, override="lr", **base))
    lrs = [m["lr"] for m in read_metrics(str(tmp_path / "run" / METRICS))[0]]
    assert lrs == pytest.approx([0.01, 0.01, 0.03, 0.03], rel=1e-12)
