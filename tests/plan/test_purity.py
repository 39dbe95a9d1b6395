"""The planner is pure: importing it pulls in no torch, no process group, no renderer."""

import subprocess
import sys

import pytest

import gradsync.models
from gradsync.errors import UsageError
from gradsync.plan.memory import resolve_param_count


def test_plan_imports_no_torch_or_renderer():
    code = (
        "import sys, gradsync.plan, gradsync.plan.units;"
        "bad = [m for m in ('torch', 'rich', 'matplotlib', 'numpy') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "", f"gradsync.plan imported {out}"


def test_builtin_name_builds_on_meta_device(monkeypatch):
    import torch
    import torch.nn as nn

    seen = {}

    def build_model(name):
        seen["device"] = torch.empty(1).device.type
        return nn.Linear(10, 10) if name == "mlp" else nn.Embedding(100, 8)

    monkeypatch.setattr(gradsync.models, "build_model", build_model, raising=False)
    assert resolve_param_count("mlp")[0] == 110
    assert resolve_param_count("GPT")[0] == 800
    assert seen["device"] == "meta"


def test_builtin_returning_non_module_is_one_line(monkeypatch):
    monkeypatch.setattr(gradsync.models, "build_model", lambda name: "nope", raising=False)
    with pytest.raises(UsageError, match="not a torch.nn.Module"):
        resolve_param_count("gpt")
