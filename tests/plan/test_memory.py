"""ZeRO's model-state numbers (arXiv 1910.02054, section 3.1); edge cases of the memory planner."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.errors import UsageError
from gradsync.plan.memory import (
    ActivationShape,
    activation_bytes,
    bytes_per_param,
    deepspeed_zero2_estimate,
    plan_memory,
    resolve_param_count,
)
from gradsync.plan.units import parse_bytes, parse_count

GB = 1e9


def test_seven_billion_times_sixteen_bytes_is_112_gb():
    plan = plan_memory(int(7e9), 1)
    assert plan.stage("DP").total == pytest.approx(112 * GB)
    assert bytes_per_param().total == 16


def test_seventy_billion_bf16_parameters_alone_are_140_gb():
    assert plan_memory(int(70e9), 1).stage("DP").params == pytest.approx(140 * GB)


def test_zero_stages_at_psi_7_5e9_n_64():
    plan = plan_memory(int(7.5e9), 64)
    got = [round(s.total / GB, 1) for s in plan.stages]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_fp32_grad_accum_is_20_bytes_and_gives_2p_plus_18p_over_n_at_stage_2():
    bpp = bytes_per_param(fp32_grad_accum=True)
    assert bpp.total == 20
    P, N = 1e9, 8
    plan = plan_memory(int(P), N, fp32_grad_accum=True)
    assert plan.stage("ZeRO-2").total == pytest.approx(2 * P + 18 * P / N)
    assert plan.stage("ZeRO-2").total == pytest.approx(deepspeed_zero2_estimate(P, N))
    assert deepspeed_zero2_estimate(P, N, legacy=True) == pytest.approx(4 * P + 16 * P / N)


@pytest.mark.parametrize(
    "opt,mixed,total",
    [("adam", False, 16), ("adamw", False, 16), ("sgd-momentum", True, 12),
     ("sgd-plain", True, 8), ("sgd-momentum", False, 12), ("sgd-plain", False, 8),
     ("sgd", True, 12), ("sgd", False, 12)],  # train's sgd has momentum 0.9: one buffer
)
def test_optimizer_and_precision_variants(opt, mixed, total):
    assert bytes_per_param(opt, mixed).total == total


def test_activation_coefficients_korthikanti():
    s, b, h, a, L = 2048, 1, 4096, 32, 2
    full = ActivationShape(b, s, h, L, a)
    assert activation_bytes(full) == L * (34 * s * b * h + 5 * a * s * s * b)
    sel = ActivationShape(b, s, h, L, a, "selective")
    assert activation_bytes(sel) == L * 34 * s * b * h
    ckpt = ActivationShape(b, s, h, L, a, "full")
    assert activation_bytes(ckpt) < activation_bytes(sel) < activation_bytes(full)


def test_fits_verdict_against_device_memory():
    plan = plan_memory(int(7.5e9), 64, device_memory=80 * GB)
    assert [s.fits for s in plan.stages] == [False, True, True, True]
    assert plan_memory(1000, 2).stage("DP").fits is None


@pytest.mark.parametrize("text,value", [("7e9", 7e9), ("7B", 7e9), ("125M", 125e6),
                                         ("1.3b", 1.3e9), ("350k", 350e3)])
def test_parse_count(text, value):
    assert parse_count(text) == int(value)


@pytest.mark.parametrize("text,value", [("80GB", 80e9), ("24GiB", 24 * 2**30),
                                         ("512MB", 512e6), ("1024", 1024)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["24XB", "-5GB", "0GB", "GB", "abc"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(UsageError):
        parse_bytes(bad)


def test_bad_sizes_rejected():
    with pytest.raises(UsageError):
        plan_memory(0, 8)
    with pytest.raises(UsageError):
        plan_memory(100, 0)
    with pytest.raises(UsageError):
        ActivationShape(0, 1, 1, 1, 1)


def test_module_factory_counts_on_meta_device():
    n, _ = resolve_param_count("tests.plan.factories:tiny_mlp")
    assert n == (8 * 16 + 16) + (16 * 4 + 4)


@pytest.mark.parametrize(
    "spec,msg",
    [("tests.plan.factories:not_a_module", "not a torch.nn.Module"),
     ("no_such_module_xyz:f", "cannot import"),
     ("tests.plan.factories:missing", "no callable"),
     ("tests.plan.factories:raises", "failed on the meta device")],
)
def test_module_factory_errors(spec, msg):
    with pytest.raises(UsageError, match=msg):
        resolve_param_count(spec)


def test_builtin_model_guarded():
    """'gpt' either counts (engine's models present) or is one clear UsageError."""
    try:
        n, _ = resolve_param_count("gpt")
    except UsageError as e:
        assert "\n" not in str(e)
    else:
        assert n > 0


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 10**12), N=st.integers(1, 4096),
       opt=st.sampled_from(["adam", "sgd-momentum", "sgd", "sgd-plain"]), mixed=st.booleans())
def test_stages_never_cost_more_than_the_one_before(P, N, opt, mixed):
    totals = [s.total for s in plan_memory(P, N, opt, mixed).stages]
    assert all(a >= b - 1e-6 * a for a, b in zip(totals, totals[1:]))
    if N == 1:
        assert totals == pytest.approx([totals[0]] * 4)
    assert totals[-1] == pytest.approx(totals[0] / N)
