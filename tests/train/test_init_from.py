"""``--init-from PATH``: a fresh run that starts from trained weights.

The claim of sameness, tested bitwise: every kind of PATH (an export in each format, a
safetensors file, a state dict, a run, a transformers directory through from_pretrained)
loads into a freshly built model whose logits equal the trained model's; and a run started
with ``--init-from`` an export trains, step for step and bit for bit, like a run whose model
factory returns those weights itself.
"""

import json
import os

import pytest
import torch

import gradsync as gs
from gradsync.errors import UnsafeFileError, UsageError
from gradsync.rundir import CHECKPOINT
from gradsync.train.checkpoint.export import export_run
from gradsync.train.task.init_from import init_weights
from tests.cli_in_process import cli_here
from tests.train import factories, hostile
from tests.train.factories import INIT_ENV, padded_arrays, tensors

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("safetensors.torch")
SPEC = "tests.train.factories:tiny64"
FLAGS = dict(workers=2, steps=3, global_batch=8, micro_batch=2, lr=0.1, warmup=1,
             optimizer="adamw", checkpoint_every=0, eval_every=0, drift_every=0,
             no_report=True, timeout=60, model=SPEC, data="tests.train.factories:regression64")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trained run, and its exports in each format."""
    root = tmp_path_factory.mktemp("init")
    run = root / "run"
    gs.train(gs.TrainConfig(**FLAGS, out=str(run)))
    exports = {}
    for fmt in ("safetensors", "torch"):
        exports[fmt] = root / f"export-{fmt}"
        export_run(str(run), fmt, str(exports[fmt]), model=SPEC)
    return run, exports


def _logits(net, gpt2=False):
    net.eval()
    with torch.no_grad():
        if gpt2:
            ids, mask, _ = padded_arrays(5, seed=4)
            return net(input_ids=ids, attention_mask=mask).logits
        return net(tensors(7, seed=5)[0])


def _trained_model(run):
    net = factories.tiny64()
    net.load_state_dict(torch.load(run / CHECKPOINT, weights_only=True)["model"])
    return net


def _fresh():
    torch.manual_seed(99)  # other values than the run's: nothing of them may survive
    return factories.tiny64()


def test_every_kind_reproduces_the_trained_logits(trained, tmp_path):
    run, exports = trained
    want = _logits(_trained_model(run))
    state_dict = tmp_path / "weights.pt"
    torch.save(_trained_model(run).state_dict(), state_dict)
    sources = [("export", exports["safetensors"]), ("export", exports["torch"]),
               ("safetensors", exports["safetensors"] / "model.safetensors"),
               ("state_dict", state_dict), ("checkpoint", run)]
    for kind, path in sources:
        net = _fresh()
        assert not torch.equal(_logits(net), want)
        assert init_weights(net, str(path), SPEC) == kind
        got = _logits(net)
        assert got.dtype == torch.float64 and torch.equal(got, want), path


def test_a_transformers_directory_through_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(5)
    saved = factories.tiny_gpt2()
    saved.save_pretrained(tmp_path / "hf")
    net = _fresh_gpt2()
    assert init_weights(net, str(tmp_path / "hf"), "tests.train.factories:tiny_gpt2") == "hf"
    assert torch.equal(_logits(net, gpt2=True), _logits(saved, gpt2=True))
    assert net.lm_head.weight.data_ptr() == net.transformer.wte.weight.data_ptr()  # still tied
    with pytest.raises(UsageError, match="not a transformers PreTrainedModel: give a "
                                         ".safetensors file instead"):
        init_weights(_fresh(), str(tmp_path / "hf"), SPEC)


def _fresh_gpt2():
    torch.manual_seed(77)
    return factories.tiny_gpt2()


def test_a_run_from_an_export_trains_as_a_factory_of_those_weights(trained, tmp_path,
                                                                    monkeypatch):
    _, exports = trained
    source = exports["safetensors"]
    ours, theirs = tmp_path / "init-from", tmp_path / "factory"
    gs.train(gs.TrainConfig(**{**FLAGS, "steps": 2}, out=str(ours), init_from=str(source)))
    monkeypatch.setenv(INIT_ENV, str(source / "model.safetensors"))
    own = "tests.train.factories:tiny64_from_env"
    gs.train(gs.TrainConfig(**{**FLAGS, "steps": 2, "model": own}, out=str(theirs)))
    rows = [[json.loads(line) for line in open(d / "metrics.jsonl")] for d in (ours, theirs)]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    a, b = (torch.load(d / CHECKPOINT, weights_only=True)["model"] for d in (ours, theirs))
    assert all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((ours / "config.json").read_text())
    assert config["init_from"] == str(source) and rows[0][0]["step"] == 1
    # continued later: the checkpoint holds the weights, and PATH is not read again
    os.rename(source, tmp_path / "moved")
    try:
        s = gs.train(gs.TrainConfig(**{**FLAGS, "steps": 3}, out=str(ours), init_from=str(source)))
    finally:
        os.rename(tmp_path / "moved", source)
    assert s["resumed_from"] == 2


def test_what_does_not_fit_or_is_not_data_is_one_line(trained, tmp_path):
    run, exports = trained
    cases = [
        (tmp_path / "nope", "no such file or directory"),
        (tmp_path / "w.bin", "ends in .safetensors, or .pt/.pth"),
        (tmp_path / "bad.safetensors", "is not a readable safetensors file"),
        (tmp_path / "hfbin", "holds only pickle weights (pytorch_model.bin)"),
        (tmp_path / "list.pt", "is not a state dict"),
    ]
    (tmp_path / "w.bin").write_bytes(b"x")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "hfbin").mkdir()
    (tmp_path / "hfbin" / "pytorch_model.bin").write_bytes(b"x")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    for path, needle in cases:
        with pytest.raises(UsageError) as e:
            init_weights(_fresh(), str(path), SPEC)
        assert needle in str(e.value) and "--init-from" in str(e.value), e.value
    with pytest.raises(UsageError, match="does not fit --model tests.train.factories:tiny32: "):
        init_weights(factories.tiny32(), str(exports["safetensors"]),
                     "tests.train.factories:tiny32")
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"w": hostile.Payload(marker)}, evil)
    with pytest.raises(UnsafeFileError, match="was not loaded"):
        init_weights(_fresh(), str(evil), SPEC)
    assert not hostile.ran(marker)


def test_the_command_line_checks_the_source_before_any_worker(tmp_path, capfd):
    r = cli_here("train", "--model", SPEC, "--data", "tests.train.factories:regression64",
                 "--global-batch", "8", "--micro-batch", "2", "--out", str(tmp_path / "r"),
                 "--init-from", str(tmp_path / "missing.safetensors"), capfd=capfd)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--init-from" in r.stderr and "no such file or directory" in r.stderr
