"""A factory typed as a relative file path (``--model ./tiny_fp.py:build``) is recorded
resolved, so the run can be exported and continued from another directory (issue 37:
config.json and the checkpoint kept ``./tiny_fp.py:build``, which export's own hint then
told the user to pass from wherever they stood, and which a resume from elsewhere could
not import)."""

import json
import os

import gradsync as gs
from gradsync.cli import main
from gradsync.factory import absolute_spec
from gradsync.rundir import CONFIG

MODEL = ("import torch\n\n\ndef build():\n"
         "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),\n"
         "                               torch.nn.Linear(16, 8))\n")
DATA = ("import torch\n\n\ndef make():\n    g = torch.Generator().manual_seed(0)\n"
        "    return torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),\n"
        "                                          torch.randn(64, 8, generator=g))\n")


def _cfg(out, steps, model, data):
    return gs.TrainConfig(workers=1, steps=steps, global_batch=8, micro_batch=8, lr=0.01,
                          warmup=0, optimizer="sgd", out=str(out), checkpoint_every=1,
                          eval_every=0, no_report=True, seed=0, timeout=60, model=model,
                          data=data)


def test_absolute_spec_leaves_modules_and_names_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("./m.py:build") == f"{tmp_path}/m.py:build"
    assert absolute_spec("sub/m.py:Cls.make") == f"{tmp_path}/sub/m.py:Cls.make"
    for same in ("gpt", "", "pkg.mod:build", "/abs/m.py:build", "adamw"):
        assert absolute_spec(same) == same


def test_a_relative_factory_path_is_recorded_resolved_and_works_elsewhere(tmp_path,
                                                                           monkeypatch):
    code, elsewhere = tmp_path / "code", tmp_path / "elsewhere"
    code.mkdir(), elsewhere.mkdir()
    (code / "tiny_fp.py").write_text(MODEL)
    (code / "tiny_fp_data.py").write_text(DATA)
    run = tmp_path / "run"
    monkeypatch.chdir(code)
    gs.train(_cfg(run, 2, "./tiny_fp.py:build", "tiny_fp_data.py:make"))
    config = json.loads((run / CONFIG).read_text())
    model, data = config["model"], config["data"]
    assert model == f"{code}/tiny_fp.py:build" and data == f"{code}/tiny_fp_data.py:make"
    monkeypatch.chdir(elsewhere)  # the recorded specs work from here
    dest = tmp_path / "export"
    assert main(["export", str(run), "--format", "torch", str(dest), "--model", model]) == 0
    assert os.path.exists(dest / "model.pt")
    summary = gs.train(_cfg(run, 3, model, data))  # continued from another directory
    assert summary["resumed_from"] == 2
