"""Resume you can reason about (issue 22): a continued run keeps its schedule and its
update rule unless told otherwise, and says what it does.

One tiny 4-step run is trained once (module scope); every decision is then checked
in-process on its real checkpoint (``state.decide`` / ``preflight``), and one
continuation is trained to see the learning rate past the planned schedule.
"""

import math
import os
import shutil

import pytest

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.rundir import CHECKPOINT, METRICS, read_metrics
from gradsync.train.checkpoint.state import decide
from gradsync.train.checkpoint.unit import read_unit
from gradsync.train.config.train_config import TrainConfig
from gradsync.train.launcher.preflight import preflight
from gradsync.train.task.schedule import finished_line, lr_factor

LR = 0.1
BASE = dict(workers=1, global_batch=8, micro_batch=4, warmup=1, lr=LR, optimizer="adamw",
            checkpoint_every=0, eval_every=0, drift_every=0, no_report=True, timeout=60,
            model="tests.train.factories:tiny64", data="tests.train.factories:regression64")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    """The run directory of a finished 4-step run (cosine planned over 4 steps)."""
    out = str(tmp_path_factory.mktemp("identity") / "run")
    gs.train(TrainConfig(steps=4, out=out, **BASE))
    return out


def _decide(out: str, **changes):
    cfg = TrainConfig(**{**BASE, "steps": 4, "out": out, **changes})
    return decide(cfg.resolved(), read_unit(os.path.join(out, CHECKPOINT)))


def test_the_schedule_past_its_plan_stays_at_its_final_rate():
    planned = TrainConfig(steps=10, warmup=2)
    continued = TrainConfig(steps=25, warmup=2, schedule_steps=10)
    f = [lr_factor(s, continued.resolved()) for s in range(25)]
    assert f[:10] == [lr_factor(s, planned.resolved()) for s in range(10)]  # the plan, unchanged
    assert f[10:] == pytest.approx([0.1] * 15) and max(f[9:]) == f[9]  # no jump back up
    assert f[9] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 8)))
    flat = TrainConfig(steps=25, warmup=2, schedule="constant", schedule_steps=10)
    assert [lr_factor(s, flat.resolved()) for s in range(2, 25)] == [1.0] * 23


def test_a_finished_run_says_how_it_continues(finished):
    plan = _decide(finished)
    assert plan.action == "finished" and plan.schedule_steps == 4
    line = finished_line(TrainConfig(**{**BASE, "steps": 4, "out": finished}).resolved(),
                         plan.step, 4)
    assert "already finished (step 4 of 4); nothing to do. A larger --steps continues it" in line
    assert "keeps its plan (warm-up 1, cosine to 0.01 over 4 steps)" in line
    assert "final rate, 0.01" in line and "--override schedule-steps" in line


def test_a_larger_steps_keeps_the_plan_unless_told_to_replan(finished):
    plan = _decide(finished, steps=9)
    assert (plan.action, plan.step, plan.schedule_steps) == ("resume", 4, 4)
    assert any("steps 5-9 train at its final rate, 0.01" in n for n in plan.notes), plan.notes
    plan = _decide(finished, steps=9, override="schedule-steps")
    assert plan.schedule_steps == 9
    assert any("--schedule-steps changes from 4 to 9 at step 5" in n for n in plan.notes)


@pytest.mark.parametrize("name,value,shown", [
    ("lr", 0.01, "--lr was 0.1, now 0.01"),
    ("warmup", 0, "--warmup was 1, now 0"),
    ("schedule", "constant", "--schedule was cosine, now constant"),
    ("schedule_steps", 12, "--schedule-steps was 4, now 12"),
    ("optimizer", "sgd", "--optimizer was adamw, now sgd"),
    ("weight_decay", 0.01, "--weight-decay was unset (the optimizer's default), now 0.01"),
    ("betas", "0.9,0.99", "--betas was unset (the optimizer's default), now 0.9,0.99"),
    ("scheduler", "my_pkg.sched:cosine", "--scheduler was unset (the built-in schedule)"),
    ("clip", 0.5, "--clip was 0, now 0.5"),
])
def test_a_changed_update_rule_is_refused_unless_overridden(finished, name, value, shown):
    with pytest.raises(UsageError) as e:
        _decide(finished, steps=6, **{name: value})
    flag = name.replace("_", "-")
    assert shown in str(e.value) and f"add --override {flag} to change it from step 5" in \
        str(e.value)
    plan = _decide(finished, steps=6, override=f"lr,{flag}", **{name: value})
    assert plan.action == "resume" and any(f"--override {flag}:" in n for n in plan.notes)


def test_a_default_given_explicitly_is_the_same_run(finished):
    plan = _decide(finished, steps=6, weight_decay=0.1, betas="0.9,0.95", schedule_steps=4)
    assert plan.action == "resume" and not any(n.startswith("--override") for n in plan.notes)


def test_override_takes_only_the_update_rule():
    with pytest.raises(UsageError, match="--steps, --workers and --micro-batch may change"):
        TrainConfig(override="lr,steps")


def test_workers_that_cannot_split_the_batch_are_told_which_can(finished, tmp_path):
    with pytest.raises(UsageError) as e:
        preflight(TrainConfig(**{**BASE, "workers": 3, "steps": 6, "out": finished}).resolved())
    msg = str(e.value)
    assert "try --global-batch" not in msg, msg
    assert "on 3 workers no micro-batch splits 8 samples; it continues on 1 worker with " \
           "--micro-batch 4, 2 with 4, 4 with 2 or 8 with 1" in msg
    with pytest.raises(UsageError, match="try --global-batch 12 or 24"):  # a new run may
        preflight(TrainConfig(**{**BASE, "workers": 3, "out": str(tmp_path / "new")}).resolved())


@pytest.mark.timeout(120)
def test_continuing_a_finished_run_trains_on_at_its_final_rate(finished, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    gs.train(TrainConfig(**{**BASE, "steps": 6, "out": out}))
    lrs = [m["lr"] for m in read_metrics(os.path.join(out, METRICS))[0]]
    plan = TrainConfig(steps=4, warmup=1).resolved()
    assert lrs[:4] == pytest.approx([LR, LR * lr_factor(1, plan), LR * lr_factor(2, plan),
                                     LR * lr_factor(3, plan)])
    assert lrs[4:] == pytest.approx([0.1 * LR] * 2, rel=1e-12)  # not back up the cosine
