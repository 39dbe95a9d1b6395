"""`gradsync export`: the trained model out of a run, loaded back into a fresh model.

Three tiny real runs (two workers, gloo), one per strategy, trained once for the
module: ddp (float64 MLP), zero2 in bf16 (the fp32 masters live in the shards, and
the export must be them, not their bf16 rounding in checkpoint.pt), and zero3 on
transformers' GPT-2 (tied embeddings, stage-3 shards whose records name the tied
weight by both its names). Every export is loaded into a freshly built model whose
outputs must equal, bit for bit, those of the trained model. Each export names its
``--model`` (a factory a run directory records is never imported on its word).
"""

import os
import shutil
import struct
import zipfile

import pytest
import torch

import gradsync as gs
from gradsync.cli import main
from gradsync.errors import UsageError
from gradsync.rundir import CHECKPOINT
from gradsync.train.checkpoint.export import PROVENANCE, export_run
from tests.train import factories
from tests.train.factories import padded_arrays, tensors

pytestmark = pytest.mark.timeout(240)
safetensors_torch = pytest.importorskip("safetensors.torch")

RUNS = {  # name -> (model, data, strategy, precision)
    "ddp": ("tiny64", "regression64", "ddp", "fp32"),
    "zero2": ("tiny32", "regression32", "zero2", "bf16"),
    "zero3": ("tiny_gpt2", "padded_tokens", "zero3", "fp32"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (model, data, strategy, precision) in RUNS.items():
        if model == "tiny_gpt2":
            pytest.importorskip("transformers")
        run = tmp_path_factory.mktemp(name) / "run"
        gs.train(gs.TrainConfig(
            workers=2, steps=3, global_batch=8, micro_batch=2, lr=0.3, warmup=1,
            optimizer="adamw", strategy=strategy, precision=precision, out=str(run),
            checkpoint_every=0, eval_every=0, drift_every=0, no_report=True, timeout=60,
            model=f"tests.train.factories:{model}", data=f"tests.train.factories:{data}"))
        out[name] = run
    return out


def _spec(name: str) -> str:
    """The run's factory, as the export's command line names it."""
    return f"tests.train.factories:{RUNS[name][0]}"


def _inputs(model: str):
    if model == "tiny_gpt2":
        ids, mask, _ = padded_arrays(6, seed=9)
        return {"input_ids": ids, "attention_mask": mask}
    return {"input": tensors(5, dtype=torch.float64 if model == "tiny64" else torch.float32,
                             seed=9)[0]}


def _outputs(net, model: str) -> torch.Tensor:
    net.eval()
    with torch.no_grad():
        x = _inputs(model)
        y = net(**x) if model == "tiny_gpt2" else net(x["input"])
    return getattr(y, "logits", y)


def _trained(run, model: str):
    """A fresh model holding checkpoint.pt's model state: the trained model of an fp32 run."""
    net = getattr(factories, model)()
    net.load_state_dict(torch.load(run / CHECKPOINT, weights_only=False)["model"])
    return net


def _load(fmt: str, dest, model: str):
    if fmt == "hf":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(dest, attn_implementation="eager")
    net = getattr(factories, model)()
    for p in net.parameters():  # nothing of the fresh model's own values may survive
        torch.nn.init.constant_(p, 7.0)
    if fmt == "safetensors":
        missing, unexpected = safetensors_torch.load_model(net, str(dest / "model.safetensors"))
        assert not missing and not unexpected
    else:
        net.load_state_dict(torch.load(dest / "model.pt", weights_only=True))
    return net


@pytest.mark.parametrize("name,fmt", [("ddp", "safetensors"), ("ddp", "torch"),
                                      ("zero3", "safetensors"), ("zero3", "torch"),
                                      ("zero3", "hf")])
def test_export_loads_into_a_fresh_model_with_the_trained_outputs(runs, tmp_path, name, fmt):
    model = RUNS[name][0]
    dest = tmp_path / "export"
    result = export_run(str(runs[name]), fmt, str(dest), model=_spec(name))
    assert result.step == 3 and result.strategy == RUNS[name][2]
    assert (dest / PROVENANCE).exists()
    got = _outputs(_load(fmt, dest, model), model)
    want = _outputs(_trained(runs[name], model), model)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if model == "tiny_gpt2":  # the tied weight is one tensor again
        net = _load(fmt, dest, model)
        assert net.lm_head.weight.data_ptr() == net.transformer.wte.weight.data_ptr()


def test_zero2_bf16_exports_the_fp32_masters_from_the_shards(runs, tmp_path):
    run, dest = runs["zero2"], tmp_path / "export"
    result = export_run(str(run), "safetensors", str(dest), model=_spec("zero2"))
    assert "master" in result.weights
    net = _load("safetensors", dest, "tiny32")
    saved = torch.load(run / CHECKPOINT, weights_only=False)["model"]  # bf16 in checkpoint.pt
    finer = 0
    for name, p in net.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach().to(torch.bfloat16), saved[name]), name  # their rounding
        finer += int(not torch.equal(p.detach(), saved[name].float()))
    assert finer, "the export holds only bf16 values: the masters were not taken"


def test_hf_refuses_a_model_that_is_not_a_transformers_model(runs, tmp_path):
    with pytest.raises(UsageError, match="use --format safetensors"):
        export_run(str(runs["ddp"]), "hf", str(tmp_path / "out"), model=_spec("ddp"))
    assert not (tmp_path / "out").exists()


def test_damaged_checkpoints_are_refused_in_one_line(runs, tmp_path):
    bad = tmp_path / "ddp"
    shutil.copytree(runs["ddp"], bad)
    with zipfile.ZipFile(bad / CHECKPOINT) as z:  # a byte of a tensor's data, not padding
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray((bad / CHECKPOINT).read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[entry.header_offset + 26:][:4])
    start = entry.header_offset + 30 + name_len + extra_len  # the local header's own lengths
    data[start + entry.file_size // 2] ^= 0xFF
    (bad / CHECKPOINT).write_bytes(bytes(data))
    with pytest.raises(UsageError) as e:
        export_run(str(bad), "torch", str(tmp_path / "a"), model=_spec("ddp"))
    assert "checkpoint" in str(e.value) and "\n" not in str(e.value)

    shards = tmp_path / "zero2"
    shutil.copytree(runs["zero2"], shards)
    shard = next(p for p in shards.rglob("shard-*.pt"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(UsageError, match="checksum") as e:
        export_run(str(shards), "torch", str(tmp_path / "b"), model=_spec("zero2"))
    assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


def test_the_cli_exports_and_says_what(runs, tmp_path, capsys):
    dest = tmp_path / "cli"
    model = ["--model", _spec("ddp")]
    assert main(["export", str(runs["ddp"]), "--format", "torch", str(dest), *model]) == 0
    assert "step 3" in capsys.readouterr().out and (dest / "model.pt").exists()
    assert main(["export", str(runs["ddp"]), "--format", "hf", str(tmp_path / "x"), *model]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync export: error:") and len(err.splitlines()) == 1
    assert main(["export", str(tmp_path / "nothing"), "--format", "torch", str(dest), *model]) == 2
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0 and "--format" in capsys.readouterr().out
    assert os.path.exists(dest / PROVENANCE)
