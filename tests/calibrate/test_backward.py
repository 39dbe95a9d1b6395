"""Per-parameter readiness from hooks: complete, once each, summing to the backward."""

import pytest

from gradsync.calibrate.backward import BackwardTiming, measure_single
from gradsync.calibrate.workload import build_workload, check_spec
from gradsync.cli import main
from gradsync.errors import UsageError
from gradsync.plan.profile import load_profile, profile_to_json

TINY = "tests.calibrate.factories:tiny"


def _trainable_names(spec):
    model = build_workload(spec).model
    return [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("spec", [TINY, "tests.calibrate.factories:tied"])
def test_every_parameter_ready_once_and_times_sum(spec):
    t = measure_single(spec, runs=2, warmup=1)
    names = [n.split(" = ")[0] for n in t.names]
    assert sorted(names) == sorted(_trainable_names(spec))  # each trainable once (tied once)
    assert sorted(t.ready_order()) == list(range(len(t.names)))
    assert all(r > 0 for r in t.ready_s)
    per = t.per_param_s()
    assert all(p >= 0 for p in per)
    assert sum(per) == pytest.approx(t.backward_s, rel=1e-9)
    assert t.forward_s > 0 and t.optimizer_s > 0


def test_tied_weight_carries_both_names():
    t = measure_single("tests.calibrate.factories:tied", runs=1, warmup=0)
    assert "emb.weight = head.weight" in t.names


def test_profile_round_trips_and_simulates(tmp_path, capsys):
    prof = measure_single(TINY, runs=2, warmup=1).to_profile(5e-4, 1e-9, 2)
    path = tmp_path / "profile.json"
    path.write_text(profile_to_json(prof))
    assert load_profile(str(path)) == prof
    assert main(["simulate", "--profile", str(path), "--json"]) == 0
    assert '"step_s"' in capsys.readouterr().out


def test_profile_lists_params_in_reverse_ready_order():
    # Gradients ready in the order b, a, c (not reverse registration): the profile
    # lists them so that reversed they are in ready order, as the engine rebuilds.
    t = BackwardTiming(("a", "b", "c"), (1, 2, 3), (4, 4, 4), ("float32",) * 3,
                       ready_s=(0.2, 0.1, 0.3), forward_s=0.1, backward_s=0.35,
                       optimizer_s=0.0, runs=1, workers=1)
    assert t.per_param_s() == pytest.approx([0.1, 0.1, 0.15])
    prof = t.to_profile(0.0, 0.0, 2)
    assert [p.name for p in prof.params] == ["c", "a", "b"]
    assert prof.backward_s == pytest.approx(0.35)


def test_unused_parameter_is_a_clear_error():
    with pytest.raises(UsageError, match="no gradient"):
        measure_single("tests.calibrate.factories:unused", runs=1, warmup=0)


@pytest.mark.parametrize("spec, match", [
    ("resnet", "unknown model"),
    ("no_such_module_xyz:build", "cannot import"),
    ("tests.calibrate.factories:missing", "no callable"),
])
def test_bad_specs(spec, match):
    with pytest.raises(UsageError, match=match):
        check_spec(spec)


def test_factory_returning_non_module():
    with pytest.raises(UsageError, match="not a torch.nn.Module"):
        build_workload("tests.calibrate.factories:not_a_module")
