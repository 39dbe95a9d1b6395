"""The learning-rate schedule: linear warm-up, then cosine decay to 10% or constant."""

import argparse
import math

import pytest

from gradsync.train.config import TrainConfig, add_arguments, from_args
from gradsync.train.session import lr_factor


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_cosine_warms_up_then_decays_to_a_tenth():
    cfg = TrainConfig(steps=10, warmup=2)
    f = [lr_factor(s, cfg) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == 1.0 and all(a > b for a, b in zip(f[2:], f[3:]))
    assert f[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_factor(10, cfg) == pytest.approx(0.1)  # the end of the planned span


def test_constant_holds_the_peak_after_warm_up():
    cfg = _parse("--steps", "10", "--warmup", "3", "--schedule", "constant")
    assert cfg.schedule == "constant"
    assert [lr_factor(s, cfg) for s in range(10)] == pytest.approx(
        [1 / 3, 2 / 3, 1.0] + [1.0] * 7)
    assert _parse().schedule == "cosine"  # the default is unchanged


def test_unknown_schedule_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--schedule", "linear")
    assert e.value.code == 2 and "invalid choice: 'linear'" in capsys.readouterr().err
