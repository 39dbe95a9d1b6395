"""Planner = train: `gradsync plan` assumes what `gradsync train` runs, and says what it assumed.

In-process only (no worker is started): the memory plan's defaults are train's
precision and optimizer state, activations not given are "not estimated" (never
0 B), `plan comm` sends train's 4-byte gradients and names every figure it did not
measure, a calibrated profile gives the latency, and `gradsync verify` takes
`--model/--data` (its real run is in tests/train/test_conventions.py).
"""

import json

import pytest
import torch
from torch import nn

from gradsync.cli import main
from gradsync.plan.memory import (
    PRECISIONS,
    STATE_BYTES,
    ActivationShape,
    activation_bytes,
    train_optimizer,
)
from gradsync.plan.profile import profile_to_json, synthetic_profile


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def one_line_error(capsys, *argv):
    assert main(list(argv)) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


def test_memory_defaults_are_trains_fp32_and_its_optimizer(capsys):
    plan = run_json(capsys, "plan", "memory", "7.5e9", "--workers", "64", "--json")
    assert (plan["precision"], plan["optimizer"]) == ("fp32", "adamw")
    assert plan["per_param"] == {"params": 4.0, "grads": 4.0, "optimizer": 8.0}
    totals = [round(s["total"] / 1e9, 1) for s in plan["stages"]]
    assert totals == [120.0, 60.9, 31.4, 1.9]  # 16P, 8P+8P/N, 4P+12P/N, 16P/N
    mlp = run_json(capsys, "plan", "memory", "mlp", "--json")  # train's auto: sgd, momentum
    assert (mlp["optimizer"], mlp["per_param"]["optimizer"]) == ("sgd", 4.0)
    bf16 = run_json(capsys, "plan", "memory", "7B", "--precision", "bf16", "--json")
    assert bf16["per_param"] == {"params": 2.0, "grads": 2.0, "optimizer": 12.0}


def test_fp16_is_planned_as_bf16_and_named_so(capsys):
    """fp16: 2-byte parameters and gradients and fp32 masters, as bf16 (activations too)."""
    shape = ["--seq-len", "1024", "--hidden", "2048", "--layers", "24", "--heads", "16"]
    fp16 = run_json(capsys, "plan", "memory", "1.3B", "--precision", "fp16", *shape, "--json")
    bf16 = run_json(capsys, "plan", "memory", "1.3B", "--precision", "bf16", *shape, "--json")
    assert fp16["precision"] == "fp16" and bf16["precision"] == "bf16"
    assert fp16["per_param"] == bf16["per_param"] == {"params": 2.0, "grads": 2.0,
                                                      "optimizer": 12.0}
    assert fp16["stages"] == bf16["stages"] and fp16["activations"] == bf16["activations"]


def test_precisions_and_auto_optimizer_are_trains():
    from gradsync.engine.strategy.registry import PRECISIONS as TRAIN_PRECISIONS
    from gradsync.train.config.train_config import TrainConfig

    assert PRECISIONS == TRAIN_PRECISIONS
    for model in ("gpt", "mlp", "tests.plan.factories:tiny_mlp"):
        data = {"tests.plan.factories:tiny_mlp": "tests.train.factories:regression64"}
        cfg = TrainConfig(model=model, data=data.get(model, ""), out="x")
        assert train_optimizer("auto", model) == cfg.optimizer_name


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_state_bytes_are_what_trains_optimizer_holds(name):
    """The planner's bytes of state per parameter, counted on train's own optimizer."""
    from gradsync.train.task.builtins import OPTIMIZERS

    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    opt = OPTIMIZERS[name]([{"params": list(model.parameters())}], 0.01)
    model(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for st in opt.state.values()
               for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    n = sum(p.numel() for p in model.parameters())
    assert held / n == STATE_BYTES[name]


def test_activations_not_given_are_not_estimated_never_zero(capsys):
    plan = run_json(capsys, "plan", "memory", "7B", "--json")
    assert plan["activations"] is None
    assert all(s["activations"] is None for s in plan["stages"])
    assert main(["plan", "memory", "7B", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert out.count("not estimated") >= 4 and "0 B" not in out
    assert "count model states only" in " ".join(out.split())


def test_activation_bytes_follow_the_precision(capsys):
    s, b, h, a, L = 256, 2, 64, 4, 3
    fp32, bf16 = ActivationShape(b, s, h, L, a, itemsize=4), ActivationShape(b, s, h, L, a)
    assert activation_bytes(bf16) == L * (34 * s * b * h + 5 * a * s * s * b)  # the paper
    assert activation_bytes(fp32) == L * (66 * s * b * h + 9 * a * s * s * b)
    shape = ["--seq-len", "256", "--micro-batch", "2", "--hidden", "64", "--layers", "3",
             "--heads", "4", "--json"]
    assert run_json(capsys, "plan", "memory", "1M", *shape)["activations"] == \
        activation_bytes(fp32)


def test_comm_sends_trains_fp32_gradients_and_names_its_assumptions(capsys):
    plan = run_json(capsys, "plan", "comm", "1e9", "--workers", "8", "--json")
    assert plan["itemsize"] == 4 and plan["grad_bytes"] == 4e9
    notes = " | ".join(plan["notes"])
    assert "latency: 0 assumed" in notes and "bandwidth: 25GB/s assumed" in notes
    assert main(["plan", "comm", "1e9", "--workers", "8"]) == 0
    assert "latency: 0 assumed" in " ".join(capsys.readouterr().out.split())
    given = run_json(capsys, "plan", "comm", "1e9", "--workers", "8", "--itemsize", "2",
                     "--latency", "5us", "--bandwidth", "10GB/s", "--json")
    assert given["notes"] == [] and given["alpha"] == pytest.approx(5e-6)


def test_comm_latency_and_bandwidth_from_a_calibrated_profile(capsys, tmp_path):
    """The ring all-reduce at the calibrated N costs what the profile charges for it."""
    alpha, bw, world = 6e-4, 0.75e9, 3
    prof = tmp_path / "profile.json"
    prof.write_text(profile_to_json(synthetic_profile(alpha_s=alpha, bandwidth=bw,
                                                      world_size=world)))
    plan = run_json(capsys, "plan", "comm", "1e6", "--workers", str(world), "--profile",
                    str(prof), "--json")
    assert plan["alpha"] == pytest.approx(alpha / (2 * (world - 1)))
    assert plan["bandwidth"] == pytest.approx(bw)
    charged = alpha + 2 * (world - 1) / world * plan["grad_bytes"] / bw  # plan/simulate's model
    assert plan["rows"][0]["ring_s"] == pytest.approx(charged)
    assert all("measured by gradsync calibrate on 3 workers" in n for n in plan["notes"][1:])


def test_comm_refuses_link_figures_beside_links(capsys, tmp_path):
    line = one_line_error(capsys, "plan", "comm", "1e6", "--links", str(tmp_path / "l.json"),
                          "--latency", "5us")
    assert "--latency does not apply with --links" in line


@pytest.mark.parametrize("argv,fragment", [
    (["--model", "tests.train.factories:tiny64", "--d", "3"], "--d belongs to the worked"),
    (["--model", "tests.train.factories:tiny64", "--sampler"], "--sampler belongs"),
    (["--data", "tests.train.factories:regression64"], "--data needs --model"),
    (["--model", "tests.train.factories:tiny64", "--data", "tests.train.factories:regression64",
      "--n", "3"], "--n 3 is too few for 2 workers"),
])
def test_verify_takes_model_and_data_and_refuses_what_does_not_apply(capsys, argv, fragment):
    assert fragment in one_line_error(capsys, "verify", *argv)
