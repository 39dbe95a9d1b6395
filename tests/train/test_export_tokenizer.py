"""``gradsync export --format hf --data SPEC``: the model and the tokenizer it was trained with.

A transformers GPT-2 trained on a data factory whose ``TrainData`` carries a tokenizer
(built offline from a word list); the hf export loads back with ``from_pretrained`` -- the
model with the trained logits bit for bit, the tokenizer encoding as the data's did.
"""

import json

import pytest
import torch

import gradsync as gs
from gradsync.rundir import CHECKPOINT
from tests.cli_in_process import cli_here
from tests.train import factories
from tests.train.factories import padded_arrays

pytestmark = pytest.mark.timeout(240)
transformers = pytest.importorskip("transformers")
F = "tests.train.factories:"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "run"
    gs.train(gs.TrainConfig(workers=2, steps=2, global_batch=8, micro_batch=2, lr=0.05,
                            warmup=1, out=str(out), checkpoint_every=0, eval_every=0,
                            drift_every=0, no_report=True, timeout=60, model=F + "tiny_gpt2",
                            data=F + "tokenized_lm"))
    return out


def test_the_hf_export_carries_the_tokenizer(run, tmp_path, capfd):
    dest = tmp_path / "hf"
    r = cli_here("export", str(run), "--format", "hf", "--model", F + "tiny_gpt2", "--data",
                 F + "tokenized_lm", str(dest), capfd=capfd)
    assert r.returncode == 0, r.stderr
    assert "tokenizer.json" in r.stdout and "no tokenizer" not in r.stdout
    tok = transformers.AutoTokenizer.from_pretrained(dest)
    want = factories.word_tokenizer()("a b z")["input_ids"]
    assert tok("a b z")["input_ids"] == want == [2, 3, 1]
    model = transformers.AutoModelForCausalLM.from_pretrained(dest, attn_implementation="eager")
    trained = factories.tiny_gpt2()
    trained.load_state_dict(torch.load(run / CHECKPOINT, weights_only=True)["model"])
    ids, mask, _ = padded_arrays(3, seed=6)
    for m in (model, trained):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           trained(input_ids=ids, attention_mask=mask).logits)
    provenance = json.loads((dest / "gradsync-export.json").read_text())
    assert provenance["tokenizer"] == type(factories.word_tokenizer()).__name__


def test_without_data_it_says_how_and_other_formats_refuse(run, tmp_path, capfd):
    r = cli_here("export", str(run), "--format", "hf", "--model", F + "tiny_gpt2",
                 str(tmp_path / "a"), capfd=capfd)
    assert r.returncode == 0 and "give --data pkg.module:factory" in r.stdout
    assert not (tmp_path / "a" / "tokenizer.json").exists()
    r = cli_here("export", str(run), "--format", "safetensors", "--model", F + "tiny_gpt2",
                 "--data", F + "tokenized_lm", str(tmp_path / "b"), capfd=capfd)
    assert r.returncode == 2 and "--format safetensors writes the weights only" in r.stderr
    assert not (tmp_path / "b").exists()
