"""Built-in models: NumPy reference init, GPT shapes, tying, causality, checkpointing, registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradsync.errors import UsageError
from gradsync.models import (
    GPT,
    MODELS,
    DeepMLP,
    GPTConfig,
    TanhMLP,
    build_model,
    count_parameters,
)

TINY = dict(seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_tanh_mlp_from_reference_init_matches_numpy_init():
    m = TanhMLP.from_reference_init(16, 32)
    g = np.random.default_rng(0)
    W1 = g.standard_normal((16, 32)) * 0.1
    W2 = g.standard_normal((32, 1)) * 0.1
    assert m.fc1.weight.dtype == torch.float64
    assert np.array_equal(m.fc1.weight.detach().numpy(), W1.T)
    assert np.array_equal(m.fc2.weight.detach().numpy(), W2.T)
    assert not m.fc1.bias.any() and not m.fc2.bias.any()
    x = np.random.default_rng(1).standard_normal((5, 16))
    ref = np.tanh(x @ W1) @ W2
    np.testing.assert_allclose(m(torch.from_numpy(x)).detach().numpy(), ref, rtol=1e-13)


def test_deep_mlp_shape():
    m = DeepMLP(width=8, depth=3)
    assert m(torch.randn(2, 8)).shape == (2, 8)
    assert count_parameters(m) == 3 * (8 * 8 + 8)
    assert count_parameters(DeepMLP()) == 8 * (1024 * 1024 + 1024)


def test_gpt_forward_shapes_and_loss():
    m = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 256, (3, 10))
    logits = m(idx)
    assert logits.shape == (3, 10, 256)
    loss = m.loss(logits, idx)
    assert loss.dim() == 0 and abs(loss.item() - np.log(256)) < 0.5
    with pytest.raises(ValueError, match="exceeds"):
        m(torch.zeros(1, 17, dtype=torch.int64))


def test_gpt_tied_weights_are_one_parameter():
    m = GPT(GPTConfig(**TINY))
    assert m.lm_head.weight is m.tok_emb.weight
    assert sum(p is m.tok_emb.weight for p in m.parameters()) == 1
    untied = GPT(GPTConfig(**TINY, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert count_parameters(untied) - count_parameters(m) == 256 * 32


def test_gpt_residual_init_is_scaled():
    m = GPT(GPTConfig(d_model=256, n_layers=8, n_heads=4, seq_len=8))
    std = m.blocks[0].fc_proj.weight.std().item()
    assert abs(std - 0.02 / 4) < 0.001
    assert abs(m.blocks[0].fc.weight.std().item() - 0.02) < 0.002


def test_gpt_is_causal():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY)).double()
    idx = torch.randint(0, 256, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_checkpointed_gpt_has_identical_gradients():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**TINY)).double()
    ckpt = GPT(GPTConfig(**TINY, checkpoint_activations=True)).double()
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    for m in (plain, ckpt):
        m.loss(m(idx[:, :-1]), idx[:, 1:]).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"d_model": 30, "n_heads": 4}, "divisible"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": 2.5}, "vocab_size"),
    ],
)
def test_gpt_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_registry():
    assert set(MODELS) == {"gpt", "mlp"}
    assert isinstance(build_model("gpt", **TINY), GPT)
    assert isinstance(build_model("mlp", width=8, depth=2), DeepMLP)
    with pytest.raises(UsageError, match="choose from gpt, mlp"):
        build_model("resnet")
    with pytest.raises(UsageError, match="unknown GPT option"):
        build_model("gpt", width=3)


def test_tanh_regressor_single_machine_final_loss():
    """The NumPy reference reaches 0.179049 after 200 full-batch SGD steps, lr 0.02."""
    from gradsync.data import make_regression

    X, y = make_regression()
    m = TanhMLP.from_reference_init(16, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.02)
    for _ in range(200):
        opt.zero_grad()
        ((m(X) - y) ** 2).mean().backward()
        opt.step()
    assert f"{((m(X) - y) ** 2).mean().item():.6f}" == "0.179049"
