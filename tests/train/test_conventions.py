"""The conventions users bring: transformers' `labels`, tuple outputs, file paths, mode flags,
the progress bar, plurals and the lock file.

Mostly in-process. Two real launches: `gradsync verify --model/--data` on a
transformers-style model (dict samples with `labels` equal to `input_ids`, a tuple
output, padding of different lengths) -- exact to 1e-12 against one process -- and
one `gs.train` of it with the model given as a file path, which leaves no lock file.
"""

import argparse
import io
import math
import os
import re
import sys
import uuid

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import gradsync as gs
from gradsync.cli import main
from gradsync.errors import UsageError
from gradsync.factory import load_factory
from gradsync.train.checkpoint.guard import RunLock
from gradsync.train.config.flags import add_arguments, from_args
from gradsync.train.config.train_config import TrainConfig
from gradsync.train.records.progress import RunDisplay
from gradsync.train.task.build import TrainData, complete

V, H, S = 11, 8, 6  # vocabulary, hidden, sequence


class TinyLM(nn.Module):
    """A causal-LM stand-in with transformers' calling convention and return_dict=False."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, H), nn.Linear(H, V)

    def forward(self, input_ids, attention_mask=None):
        hidden = torch.tanh(self.emb(input_ids))
        if attention_mask is not None:
            hidden = hidden * attention_mask.unsqueeze(-1)
        return self.head(hidden), hidden  # (logits, hidden states)


def tiny_lm() -> nn.Module:
    return TinyLM()


def lm_rows(n: int = 24) -> list[dict]:
    """datasets-style rows (lists, not tensors): labels = input_ids, -100 on the padding,
    which grows with the row so ranks hold different numbers of tokens."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(1, V, (S,), generator=g).tolist()
        real = S - i % 4
        mask = [1] * real + [0] * (S - real)
        ids = ids[:real] + [0] * (S - real)
        rows.append({"input_ids": ids, "attention_mask": mask,
                     "labels": ids[:real] + [-100] * (S - real)})
    return rows


# --------------------------------------------------------------- samples and outputs
def test_transformers_causal_layout_is_shifted_like_transformers():
    data = complete(lm_rows())
    x, y = data.collate_fn([data.train[i] for i in range(5)])
    assert sorted(x) == ["attention_mask", "input_ids"] and y.shape == (5, S)
    logits, _ = TinyLM()(**x)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1),
                           ignore_index=-100)
    assert torch.allclose(data.loss_fn((logits, None), y), want)  # a tuple: (logits, ...)
    assert data.items_fn(x, y) == int((y[:, 1:] != -100).sum()) and data.item_name == "tokens"


@pytest.mark.parametrize("key", ["labels", "label"])  # "label": a datasets column
def test_labels_that_are_not_the_inputs_are_used_as_given(key):
    rows = [{"input_ids": torch.arange(S), key: torch.tensor(i % 3)} for i in range(4)]
    data = complete(rows)  # sequence classification: one label per sample
    x, y = data.collate_fn(rows)
    logits = torch.randn(4, 3)
    assert torch.allclose(data.loss_fn(logits, y), F.cross_entropy(logits, y))
    assert data.items_fn(x, y) == 4 and data.item_name == "samples"


def test_a_collate_fn_may_return_transformers_batch_dict():
    def pad(samples):
        return {"input_ids": torch.stack([s["input_ids"] for s in samples]),
                "labels": torch.stack([s["input_ids"] for s in samples])}

    rows = [{"input_ids": torch.arange(S) % V} for _ in range(3)]
    data = complete(TrainData(rows, collate_fn=pad))
    x, y = data.collate_fn(rows)
    assert list(x) == ["input_ids"] and y.shape == (3, S)
    assert data.items_fn(x, y) == 3 * (S - 1)  # labels == input_ids: shifted


@pytest.mark.parametrize("rows,fragment", [
    ([{"input_ids": [1, 2]}], "no 'labels'; add the targets as 'labels'"),
    ([{"labels": [1, 2]}], "holds only 'labels'"),
    ([[1, 2, 3]], "an (input, target) pair or a dict with 'labels'"),
    (TrainData([{"input_ids": [1]}], collate_fn=lambda s: {"input_ids": 1}),
     "the collate_fn returned a dict with keys ['input_ids'] and no 'labels'"),
])
def test_samples_that_cannot_be_read_are_one_line(rows, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        complete(rows)


def test_a_tuple_output_without_logits_first_names_the_fix():
    data = complete([(torch.randn(3), torch.tensor(1))] * 2)
    y = torch.tensor([1, 0])
    assert torch.allclose(data.loss_fn((torch.zeros(2, 3), "aux"), y), torch.tensor(math.log(3)))
    for bad in ((None, torch.zeros(2, 3)), (), "text"):
        with pytest.raises(UsageError, match="loss_fn"):
            data.loss_fn(bad, y)


# --------------------------------------------------------------------- factory specs
def _module_file(tmp_path, body: str) -> tuple[str, str]:
    name = f"mycnn_{uuid.uuid4().hex[:8]}"
    sub = tmp_path / "models"
    sub.mkdir(exist_ok=True)
    (sub / f"{name}.py").write_text(body)
    return name, str(sub / f"{name}.py")


def test_a_file_path_is_a_factory(tmp_path, monkeypatch):
    name, path = _module_file(tmp_path, "import torch\ndef build():\n"
                                        "    return torch.nn.Linear(2, 3)\n")
    monkeypatch.chdir(tmp_path)
    for spec in (f"./models/{name}.py:build", f"models/{name}.py:build", f"{path}:build"):
        assert isinstance(load_factory(spec)(), nn.Linear)
    assert sys.modules[name].__file__ == path  # imported under its own, importable name


def test_import_errors_say_where_to_look(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"no module named 'nowhere_zz' on the path .*run from "
                                         r"the directory that holds nowhere_zz\.py .* PYTHONPATH"):
        load_factory("nowhere_zz:build")
    _, dep = _module_file(tmp_path, "import not_installed_zz\ndef build(): pass\n")
    with pytest.raises(UsageError, match="it imports 'not_installed_zz', which is neither"):
        load_factory(f"{dep}:build")
    _, rel = _module_file(tmp_path, "from .x import y\ndef build(): pass\n")
    with pytest.raises(UsageError, match="relative imports, so import it as part of its package"):
        load_factory(f"{rel}:build")
    (tmp_path / "json.py").write_text("def build(): pass\n")
    with pytest.raises(UsageError, match="'json' is already taken by .*rename the file"):
        load_factory("./json.py:build")
    with pytest.raises(UsageError, match="no such file"):
        load_factory("./absent.py:build")


# ------------------------------------------------------------------------ mode flags
@pytest.mark.parametrize("argv,fragment", [
    (["--sync-every", "10"], "--sync-every 10 has no effect with --sync exact: it needs "
                             "--sync diloco or --sync streaming-diloco"),
    (["--sync", "diloco", "--fragments", "4"], "--fragments 4 has no effect with --sync diloco"),
    (["--sync-delay", "2"], "--sync-delay 2 has no effect"),
    (["--outer-lr", "1"], "--outer-lr 1.0 has no effect"),
    (["--probe-every", "5"], "--probe-every 5 has no effect with --sync exact and no --compress"),
    (["--sync", "diloco", "--compress", "int8", "--probe-every", "5"], "it needs --compress"),
    (["--baseline-steps", "3"], "--baseline-steps 3 has no effect with no --baseline"),
])
def test_a_flag_of_another_mode_is_refused_naming_what_enables_it(argv, fragment):
    """Parsed as `gradsync train` parses them (nothing is launched, even if one passed)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UsageError) as e:
        from_args(parser.parse_args(argv))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_mode_flags_in_their_mode_or_at_their_defaults_pass():
    TrainConfig(out="x", sync="streaming-diloco", sync_every=8, fragments=4, sync_delay=2,
                sync_alpha=0.3, outer_lr=1.0)
    TrainConfig(out="x", compress="int8", probe_every=5)
    TrainConfig(out="x", probe_every=0, sync_every=25)  # off, and the default: nothing changes
    TrainConfig(out="x", baseline=True, baseline_steps=3)


def test_plurals():
    with pytest.raises(UsageError, match=r"--micro-batch 4 x 1 worker = 4;"):
        TrainConfig(out="x", global_batch=6, micro_batch=4).accumulation(1)


# ----------------------------------------------------------------------- progress bar
def test_progress_bar_fits_80_columns_and_shows_no_nan_before_the_first_step():
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    display = RunDisplay(100_000, 0, "samples", console=console)
    console.print(display.progress.get_renderable())
    display.update(33_333, 2.5, 1_234_567.0, 0.25)
    console.print(display.progress.get_renderable())
    first, later = buf.getvalue().splitlines()
    assert "nan" not in first and "loss -" in first and "- samples/s" in first
    assert "loss 2.5000" in later and "1.23M samples/s" in later
    for line in (first, later):
        assert len(line) <= 80 and line.rstrip().endswith("0:00:00 -:--:--"), line


# ----------------------------------------------------------------------------- lock
def test_the_lock_file_is_removed_and_a_removed_lock_cannot_admit_two(tmp_path, monkeypatch):
    """B opened the file just before A removed it, and locks the orphan after A closes it:
    B must notice the path no longer names that file, or C, creating a new one, would
    hold the lock beside it."""
    out = str(tmp_path)
    a = RunLock(out).acquire()
    orphan = os.open(a.path, os.O_RDWR)  # B's open, before A's release
    a.release()
    assert not os.path.exists(a.path)
    from gradsync.train.checkpoint import guard

    real_open, calls = os.open, []

    def slow_open(path, *args):
        calls.append(path)
        return orphan if len(calls) == 1 else real_open(path, *args)

    monkeypatch.setattr(guard.os, "open", slow_open)
    b = RunLock(out).acquire()
    monkeypatch.setattr(guard.os, "open", real_open)
    assert len(calls) == 2 and os.fstat(b.fd).st_ino == os.stat(b.path).st_ino
    with pytest.raises(UsageError, match="in use by another gradsync run"):
        RunLock(out).acquire()
    b.release()
    assert os.listdir(out) == []


# ----------------------------------------------------------------------- real launches
@pytest.mark.timeout(180)
def test_verify_on_a_transformers_style_model_is_exact(capsys):
    code = main(["verify", "--model", f"{__name__}:tiny_lm", "--data", f"{__name__}:lm_rows",
                 "--n", "8", "--steps", "2"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "PASS" in out, out
    assert "num_items weighting (tokens)" in out
    mean_of_means = float(out.split("average of means")[1].split("gap ")[1].split()[0])
    assert mean_of_means > 1e-6  # ranks hold different numbers of tokens: DDP's mean is off


@pytest.mark.timeout(180)
def test_train_takes_a_file_path_and_the_transformers_layout_and_leaves_no_lock(tmp_path):
    here = os.path.abspath(__file__)
    out = tmp_path / "run"
    summary = gs.train(gs.TrainConfig(
        out=str(out), steps=2, workers=2, global_batch=4, micro_batch=2, optimizer="sgd",
        eval_every=0, checkpoint_every=0, drift_every=0, no_report=True, timeout=60),
        model=f"{here}:tiny_lm", data=f"{__name__}:lm_rows")
    assert summary is not None and math.isfinite(summary["final_loss"])
    assert not (out / "gradsync.lock").exists() and (out / "summary.json").exists()
