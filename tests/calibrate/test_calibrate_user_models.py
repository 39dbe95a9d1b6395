"""`gradsync calibrate --model module:factory` on Hugging Face transformers models.

The models are tiny, built from their configs (no download). Their forward
returns a ``ModelOutput``; calibrate's generic loss reads its ``logits`` as
``gradsync train``'s default loss does. A model with fewer positions than
``--seq-len`` is bad input: one line, exit 2, naming the input shape and the flag.
The factories live here so spawned workers can import them by name.
"""

from __future__ import annotations

import pytest
import torch

from gradsync.calibrate.workload import build_workload, output_logits
from gradsync.cli import main
from gradsync.plan.profile import load_profile

HERE = "tests.calibrate.test_calibrate_user_models"
POSITIONS = 64  # below calibrate's default --seq-len of 128


def factory():
    """A tiny LlamaForCausalLM (the model of the original bug report)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=POSITIONS))


def gpt2():
    """GPT-2 has a learned position table of ``n_positions`` rows."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=POSITIONS, n_embd=32,
                                      n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=POSITIONS))


def _small_sizes(monkeypatch):
    import gradsync.calibrate.collectives as coll

    monkeypatch.setattr(coll, "default_sizes", lambda quick: [4096, 65536, 1 << 20])
    monkeypatch.setattr("gradsync.calibrate.session.default_sizes", coll.default_sizes)


def test_output_logits_mirrors_train_default_loss():
    t = torch.ones(2, 3)
    assert output_logits(t) is t
    assert output_logits((t, None)) is t and output_logits([t]) is t
    assert output_logits({"loss": None, "logits": t}) is t
    assert output_logits({"last_hidden_state": t}) is t
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=t)
    assert output_logits(out) is t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["factory", "gpt2", "bert"])
def test_transformers_model_backward_is_timed(name):
    pytest.importorskip("transformers")
    from gradsync.calibrate.backward import measure_single

    work = build_workload(f"{HERE}:{name}", micro_batch=2, seq_len=16)
    assert work.loss(work.model).ndim == 0
    t = measure_single(f"{HERE}:{name}", micro_batch=2, seq_len=16, runs=1, warmup=0)
    trainable = [p for p in work.model.parameters() if p.requires_grad]
    assert len(t.names) == len(trainable) and t.backward_s > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_cli_on_transformers_llama(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    _small_sizes(monkeypatch)
    out = tmp_path / "p.json"
    code = main(["calibrate", "--model", f"{HERE}:factory", "--quick", "--workers", "2",
                 "--micro-batch", "2", "--seq-len", "16", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    prof = load_profile(str(out))
    n = sum(1 for p in factory().parameters() if p.requires_grad)
    assert prof.world_size == 2 and len(prof.params) == n
    assert prof.forward_s > 0 and sum(q.backward_s for q in prof.params) > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, error", [("gpt2", "IndexError"), ("bert", "RuntimeError")])
def test_seq_len_beyond_positions_is_one_line_exit_2(tmp_path, capsys, name, error):
    pytest.importorskip("transformers")
    out = tmp_path / "p.json"
    code = main(["calibrate", "--model", f"{HERE}:{name}", "--quick", "--workers", "2",
                 "--micro-batch", "2", "--out", str(out)])  # default --seq-len 128 > 64
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("gradsync calibrate: error:"), line
    assert "failed on the calibration input" in line and "2x128" in line, line
    assert "--seq-len" in line and error in line, line
    assert not out.exists()
