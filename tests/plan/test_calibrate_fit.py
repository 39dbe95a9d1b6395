"""The alpha-beta fit recovers known parameters from noisy synthetic timings."""

import random

import pytest

from gradsync.errors import UsageError
from gradsync.plan.calibrate_fit import fit_alpha_beta


def synthetic(alpha, beta, noise, seed=0):
    rng = random.Random(seed)
    sizes = [2**k for k in range(16, 28)] * 3  # 64 KiB .. 128 MiB, three repeats
    times = [(alpha + beta * n) * (1 + rng.gauss(0, noise)) for n in sizes]
    return sizes, times


@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_recovers_alpha_beta_from_noisy_timings(weighting):
    alpha, beta = 6e-4, 1 / 0.75e9  # gloo over loopback here: about 0.6 ms latency, 0.75 GB/s
    sizes, times = synthetic(alpha, beta, noise=0.03)
    fit = fit_alpha_beta(sizes, times, weighting=weighting)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.03)
    assert fit.r2 > 0.99
    if weighting == "relative":
        # absolute least squares lets big messages dominate and mis-pins the latency,
        # which is why the relative weighting is the default
        assert fit.alpha_s == pytest.approx(alpha, rel=0.1)
        assert fit.max_rel_residual < 0.15
    assert fit.bandwidth == pytest.approx(0.75e9, rel=0.03)


def test_exact_data_is_exact():
    sizes = [1e3, 1e6, 1e8]
    fit = fit_alpha_beta(sizes, [1e-4 + 2e-9 * n for n in sizes])
    assert fit.alpha_s == pytest.approx(1e-4) and fit.beta_s_per_byte == pytest.approx(2e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_residual < 1e-9
    assert fit.predict(1e7) == pytest.approx(1e-4 + 2e-2)


def test_quality_flags_a_bad_fit():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    times = [1e-3, 5e-2, 1e-3, 5e-2, 2e-2]  # no linear law here
    fit = fit_alpha_beta(sizes, times)
    assert fit.r2 < 0.5 or fit.max_rel_residual > 0.5


def test_clamps_negative_latency():
    fit = fit_alpha_beta([1e6, 2e6, 3e6], [0.9e-3, 2.1e-3, 3.0e-3])
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte > 0


@pytest.mark.parametrize("sizes,times", [([1], [1]), ([1, 1], [1, 2]), ([1, 2], [1]),
                                         ([1, 2], [0, 1])])
def test_fit_bad_input(sizes, times):
    with pytest.raises(UsageError):
        fit_alpha_beta(sizes, times)
