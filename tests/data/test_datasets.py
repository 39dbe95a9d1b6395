"""The stdlib corpus, token windows, random tokens and the tanh regression data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gradsync.data import (
    RegressionDataset,
    TokenWindows,
    corpus,
    make_regression,
    random_tokens,
    stdlib_bytes,
    stdlib_tokens,
)
from gradsync.data.corpus import stdlib_files


def test_corpus_is_deterministic_and_bounded():
    a = stdlib_tokens()
    b = stdlib_tokens()
    assert torch.equal(a, b)
    assert a.dtype == torch.uint8 and a.dim() == 1
    assert 0 < a.numel() <= 4 * 1024 * 1024
    assert int(a.max()) < 256
    assert stdlib_bytes(1000) == stdlib_bytes()[:1000]


@pytest.mark.parametrize("max_bytes", [1000, 4 * 1024 * 1024])
def test_corpus_reads_only_the_files_it_needs(monkeypatch, max_bytes):
    """Cheap because it stops early, not because this machine is fast: the files read are
    the shortest prefix of the sorted list that holds ``max_bytes``, each opened once."""
    opened = []

    def counting_open(path, *args, **kwargs):
        opened.append(path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(corpus, "open", counting_open, raising=False)
    data = stdlib_bytes(max_bytes)
    files = stdlib_files()
    sizes = [os.path.getsize(f) for f in files]
    need = next((k for k in range(1, len(files) + 1) if sum(sizes[:k]) >= max_bytes),
                len(files))
    assert opened == files[:need]
    assert len(data) == min(max_bytes, sum(sizes))


def test_corpus_skips_tests_and_vendored_dirs():
    files = stdlib_files()
    assert files == sorted(files) and files
    for skipped in ("test", "tests", "idlelib", "site-packages", "lib2to3"):
        assert not any(f"/{skipped}/" in f for f in files), skipped


def test_token_windows_shift_by_one():
    tokens = torch.arange(23, dtype=torch.uint8)
    ds = TokenWindows(tokens, seq_len=4)
    assert len(ds) == 23 // 5
    x, y = ds[1]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="too few"):
        TokenWindows(tokens[:4], seq_len=4)


def test_token_windows_on_corpus():
    ds = TokenWindows(stdlib_tokens(10_000), seq_len=64)
    x, y = ds[3]
    assert torch.equal(x[1:], y[:-1])


def test_random_tokens():
    a = random_tokens(1000, seed=1)
    assert a.dtype == torch.int64 and 0 <= int(a.min()) and int(a.max()) < 256
    assert torch.equal(a, random_tokens(1000, seed=1))
    assert not torch.equal(a, random_tokens(1000, seed=2))


def test_regression_matches_numpy_default_rng_7():
    X, y = make_regression()
    rng = np.random.default_rng(7)
    X_ref = rng.standard_normal((4096, 16))
    w_star = rng.standard_normal((16, 1))
    y_ref = np.tanh(X_ref @ w_star) + 0.05 * rng.standard_normal((4096, 1))
    assert X.dtype == y.dtype == torch.float64
    assert X.shape == (4096, 16) and y.shape == (4096, 1)
    assert X[0, :4].tolist() == X_ref[0, :4].tolist()
    assert np.array_equal(X.numpy(), X_ref) and np.array_equal(y.numpy(), y_ref)


def test_regression_dataset():
    ds = RegressionDataset(n=64, d=4)
    assert len(ds) == 64
    x, y = ds[5]
    assert x.shape == (4,) and y.shape == (1,)
    with pytest.raises(ValueError, match="rows"):
        RegressionDataset(torch.zeros(3, 2), torch.zeros(4, 1))
