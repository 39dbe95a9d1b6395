"""Issue 34, defects 3, 5 and 6 (export): gradsync export runs no code a run names,
overwrites nothing that is not its own, and says full or read-only storage in one line.

One real run (ddp, the tiny float32 MLP, 2 workers) exported through the real CLI:

* defect 3: a checkpoint whose config names ``--model DIR/evil.py:build`` made export
  import that file (its import creates a marker) and call ``build()`` at 4ab900c;
  now the factory is imported only when the command line names it;
* defect 5: export replaced someone's ``DIR/model.safetensors`` or ``model.pt``; now
  only a new or empty ``DIR``, or one holding a gradsync export, is written without
  ``--overwrite``;
* defect 6: a read-only file system (a tmpfs remounted ``ro``) was an OSError
  traceback, a full one with safetensors a SafetensorError traceback; now each is one
  line naming the file (exit 1), with no file left half-written. Exported files get
  the permissions the umask gives (``model.safetensors`` was 0600, ``model.pt`` 0644).
"""

import json
import os
import shutil
import stat

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.train.checkpoint.export import PROVENANCE, model_spec
from tests.cli_in_process import cli_here
from tests.train.hostile import evil_factory, ran
from tests.train.test_guards import tmpfs

pytestmark = pytest.mark.timeout(180)
pytest.importorskip("safetensors.torch")

MODEL = "tests.train.factories:tiny32"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    gs.train(gs.TrainConfig(workers=2, steps=2, global_batch=4, micro_batch=2, optimizer="sgd",
                            eval_every=0, drift_every=0, no_report=True, timeout=60,
                            model=MODEL, data="tests.train.factories:regression32",
                            out=str(out)))
    return out


def _export(run, dest, fmt, capfd, *extra):
    return cli_here("export", str(run), "--format", fmt, str(dest), "--model", MODEL, *extra,
                    capfd=capfd)


def _one_line(r, code: int, *needles) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("gradsync export: error: ") and "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_export_never_imports_the_factory_a_run_directory_names(run, tmp_path, capfd):
    theirs = tmp_path / "theirs"
    shutil.copytree(run, theirs)
    marker = tmp_path / "imported"
    spec = evil_factory(theirs, marker)
    state = torch.load(theirs / "checkpoint.pt", weights_only=True)
    state["config"]["model"] = spec
    torch.save(state, theirs / "checkpoint.pt")
    dest = tmp_path / "out"
    r = cli_here("export", str(theirs), "--format", "torch", str(dest), capfd=capfd)
    assert not ran(marker)
    _one_line(r, 2, f"{theirs} was trained with --model {spec}", f"pass --model {spec}")
    assert not dest.exists()
    r = cli_here("export", str(theirs), "--format", "torch", str(dest), "--model", spec,
                 capfd=capfd)  # named on the command line: the user's choice to import it
    assert ran(marker)
    _one_line(r, 2, "does not fit --model")  # its build() is not the run's model


def test_the_factory_hint_is_safe_to_paste_and_built_ins_need_no_flag():
    with pytest.raises(UsageError) as e:
        model_spec(None, {"model": "x.py:build; rm -rf ~"}, "RUN")
    assert "pass --model 'x.py:build; rm -rf ~'" in str(e.value)
    assert model_spec(None, {"model": "mlp"}, "RUN") == "mlp"
    assert model_spec("pkg.mod:f", {"model": "gpt"}, "RUN") == "pkg.mod:f"


@pytest.mark.parametrize("fmt,name", [("safetensors", "model.safetensors"),
                                      ("torch", "model.pt")])
def test_someone_elses_model_file_is_refused_and_overwrite_replaces_it(run, tmp_path, capfd,
                                                                       fmt, name):
    dest = tmp_path / "theirs"
    dest.mkdir()
    (dest / name).write_bytes(b"their weights")
    (dest / "README.md").write_text("their notes")
    r = _export(run, dest, fmt, capfd)
    assert (dest / name).read_bytes() == b"their weights"
    _one_line(r, 2, f"{dest} holds files gradsync did not write (README.md, {name})",
              "pass --overwrite")
    assert sorted(os.listdir(dest)) == ["README.md", name]
    r = _export(run, dest, fmt, capfd, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (dest / name).read_bytes() != b"their weights"
    assert (dest / "README.md").read_text() == "their notes"
    assert json.loads((dest / PROVENANCE).read_text())["format"] == fmt


def test_a_directory_holding_a_gradsync_export_is_gradsyncs(run, tmp_path, capfd):
    dest = tmp_path / "export"
    assert _export(run, dest, "safetensors", capfd).returncode == 0
    assert _export(run, dest, "torch", capfd).returncode == 0  # into its own export: no flag
    assert sorted(os.listdir(dest)) == sorted([PROVENANCE, "model.safetensors", "model.pt"])
    (tmp_path / "file").write_text("x")
    _one_line(_export(run, tmp_path / "file", "torch", capfd), 2, "is not a directory")


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_exported_files_get_the_permissions_the_umask_gives(run, tmp_path, capfd, umask):
    dest = tmp_path / "export"
    old = os.umask(umask)
    try:
        for fmt in ("safetensors", "torch"):
            assert _export(run, dest, fmt, capfd).returncode == 0
    finally:
        os.umask(old)
    for name in ("model.safetensors", "model.pt", PROVENANCE):
        assert stat.S_IMODE(os.stat(dest / name).st_mode) == 0o666 & ~umask, name


@pytest.mark.parametrize("fmt,name", [("safetensors", "model.safetensors"),
                                      ("torch", "model.pt")])
def test_a_read_only_file_system_is_one_line(run, tmp_path, capfd, fmt, name):
    with tmpfs(tmp_path / "ro", "size=1m") as mnt:
        (mnt / "kept").mkdir()  # an existing export directory, then a new one
        os.sync()
        import subprocess

        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=30)
        line = _one_line(_export(run, mnt / "kept", fmt, capfd), 1)
        assert line.startswith(f"gradsync export: error: read-only file system while writing "
                               f"the exported model to {mnt / 'kept' / name}"), line
        assert "once that is fixed, run again: gradsync export" in line
        line = _one_line(_export(run, mnt / "new", fmt, capfd), 1)
        assert f"read-only file system while creating {mnt / 'new'}" in line, line
        assert os.listdir(mnt / "kept") == [] and not (mnt / "new").exists()


def _fill(mnt) -> None:
    """Fill the file system to the last byte."""
    with open(mnt / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"\0" * 4096)


@pytest.mark.parametrize("fmt,name", [("safetensors", "model.safetensors"),
                                      ("torch", "model.pt")])
def test_a_full_file_system_is_one_line_and_leaves_no_half_file(run, tmp_path, capfd, fmt,
                                                                 name):
    with tmpfs(tmp_path / "full", "size=256k") as mnt:
        (mnt / "export").mkdir()
        _fill(mnt)
        line = _one_line(_export(run, mnt / "export", fmt, capfd), 1)
        assert line.startswith(f"gradsync export: error: no space left on device while "
                               f"writing the exported model to {mnt / 'export' / name}"), line
        assert os.listdir(mnt / "export") == []
