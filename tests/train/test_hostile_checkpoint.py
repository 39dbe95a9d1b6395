"""Issue 34, defects 1 and 2: a crafted pickle in a run directory never runs, on any path.

Two real runs (ddp; ZeRO-2 with its shard directory), then a payload planted the way
an attacker would plant it (``tests/train/hostile.py``): in ``checkpoint.pt`` (one
extra key), or in a ZeRO shard file with the manifest's and the unit record's
SHA-256s rewritten to match, so every checksum passes. Unpickled in full, the payload
creates a marker file; every test checks the marker is absent. Every path that reads
a checkpoint is tried: the launcher's preflight (resume, ``--resume never``, another
``--model``, "already finished"), rank 0 and every rank of a worker group started
without the launcher (as under torchrun), ``gs.train``, the hints that offer a step
to continue from, ``gradsync export`` in every format, and export's hint that the
safetensors package is missing. Each refusal is one line naming the file, exit 2.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest

import gradsync as gs
from gradsync.engine.sharded.checkpoint import _read_verified
from gradsync.errors import UnsafeFileError, UsageError
from gradsync.train.__main__ import TORCHRUN_AGAIN
from gradsync.train.checkpoint.format import load_checkpoint
from gradsync.train.checkpoint.restarts import where_to_continue
from tests.cli_in_process import cli_here
from tests.train.hostile import plant_in_checkpoint, plant_in_shard, ran

pytestmark = pytest.mark.timeout(240)

TINY = dict(global_batch=4, micro_batch=2, optimizer="sgd", eval_every=0, drift_every=0,
            no_report=True, timeout=60, model="tests.train.factories:tiny32",
            data="tests.train.factories:regression32")
FLAGS = ["--model", TINY["model"], "--data", TINY["data"], "--optimizer", "sgd",
         "--global-batch", "4", "--micro-batch", "2", "--eval-every", "0", "--drift-every", "0",
         "--no-report", "--timeout", "60"]
STRATEGY = {"checkpoint": "ddp", "shard": "zero2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    for strategy in ("ddp", "zero2"):
        gs.train(gs.TrainConfig(workers=2, steps=2, strategy=strategy,
                                out=str(root / strategy), **TINY))
    return {s: root / s for s in ("ddp", "zero2")}


def _hostile(runs, tmp_path: Path, where: str) -> tuple[Path, Path, Path]:
    """(run directory, the marker its payload would create, the file that holds it)."""
    run = tmp_path / "run"
    shutil.copytree(runs[STRATEGY[where]], run)
    marker = tmp_path / "payload-ran"
    planted = plant_in_checkpoint(run, marker) if where == "checkpoint" \
        else plant_in_shard(run, marker)
    return run, marker, planted


def _refused(r, planted: Path) -> str:
    """Exit 2, one line, naming the planted file and saying it was not loaded."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    assert f"{planted} was not loaded: unpickling it would import and call exec" \
        in lines[0], lines[0]
    assert "--trust-checkpoint-code" in lines[0] and "Traceback" not in r.stderr + r.stdout
    return lines[0]


CASES = {  # what the command line says -> the flags beyond FLAGS and --out
    "resume": ["--steps", "4"],
    "resume-never": ["--steps", "4", "--resume", "never"],
    "another-model": ["--steps", "4", "--model", "tests.train.factories:tiny64"],
    "already-finished": ["--steps", "2"],
}


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradsync_train_never_runs_a_planted_pickle(runs, tmp_path, capfd, where, case):
    run, marker, planted = _hostile(runs, tmp_path, where)
    r = cli_here("train", *FLAGS, "--strategy", STRATEGY[where], *CASES[case], "--out",
                 str(run), capfd=capfd)
    assert not ran(marker)
    _refused(r, planted)


def _worker_group(run: str, strategy: str):
    """Every rank of a group started without gradsync's launcher (as torchrun starts
    them): rank 0 reads the checkpoint and shares its answer (``train/session.py``)."""
    try:
        gs.train(gs.TrainConfig(steps=4, strategy=strategy, out=run, **TINY))
    except UsageError as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
def test_every_rank_of_a_worker_group_refuses_it(runs, tmp_path, where):
    run, marker, planted = _hostile(runs, tmp_path, where)
    said = gs.spawn(_worker_group, 2, str(run), STRATEGY[where], timeout_s=90)
    assert not ran(marker)
    assert said[0] == said[1] and "\n" not in said[0], said
    assert f"{planted} was not loaded" in said[0], said[0]


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
def test_the_loads_every_rank_makes_refuse_it_too(runs, tmp_path, where):
    """What each rank calls once rank 0 decided to resume: ``checkpoint.pt`` whole, and
    the engine's sharded reader (behind rank 0's check, they refuse on their own)."""
    run, marker, planted = _hostile(runs, tmp_path, where)
    with pytest.raises(UnsafeFileError, match="was not loaded") as e:
        if where == "checkpoint":
            load_checkpoint(str(run / "checkpoint.pt"), verified=False)
        else:
            _read_verified(planted.parent)
    assert not ran(marker) and str(planted) in str(e.value) and "\n" not in str(e.value)


def test_gs_train_refuses_it(runs, tmp_path):
    run, marker, planted = _hostile(runs, tmp_path, "checkpoint")
    with pytest.raises(UnsafeFileError, match="was not loaded"):
        gs.train(gs.TrainConfig(workers=2, steps=4, out=str(run), **TINY))
    assert not ran(marker)


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
def test_the_hints_after_a_failure_refuse_it(runs, tmp_path, where):
    """"continue from step N" after a failed run (``gradsync train``, and the worker
    entry point torchrun starts) reads the checkpoint: as data only."""
    run, marker, planted = _hostile(runs, tmp_path, where)
    for hint in (where_to_continue(str(run), False, "gradsync train", failed=True),
                 where_to_continue(str(run), False, TORCHRUN_AGAIN, failed=True)):
        assert "no usable checkpoint to continue from" in hint and f"{planted} was not " \
            "loaded" in hint and "\n" not in hint, hint
    assert not ran(marker)


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
@pytest.mark.parametrize("fmt", ["safetensors", "torch", "hf"])
def test_gradsync_export_refuses_it_in_every_format(runs, tmp_path, capfd, where, fmt):
    run, marker, planted = _hostile(runs, tmp_path, where)
    dest = tmp_path / "export"
    r = cli_here("export", str(run), "--format", fmt, str(dest), "--model", TINY["model"],
                 capfd=capfd)
    assert not ran(marker)
    _refused(r, planted)
    assert not dest.exists()


def test_export_says_safetensors_is_missing_without_reading_the_checkpoint(runs, tmp_path,
                                                                          capfd, monkeypatch):
    run, marker, _ = _hostile(runs, tmp_path, "checkpoint")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors: ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    r = cli_here("export", str(run), "--format", "safetensors", str(tmp_path / "out"),
                 "--model", TINY["model"], capfd=capfd)
    assert not ran(marker)
    assert r.returncode == 2 and "needs the safetensors package" in r.stderr, r.stderr


def test_trust_checkpoint_code_is_the_users_explicit_way_past(runs, tmp_path, capfd):
    """The opt-in does what it says (here the payload is harmless): full unpickling."""
    run, marker, _ = _hostile(runs, tmp_path, "checkpoint")
    r = cli_here("train", *FLAGS, "--steps", "4", "--resume", "never", "--out", str(run),
                 "--trust-checkpoint-code", capfd=capfd)
    assert ran(marker)
    assert r.returncode == 2 and "already holds a checkpoint (step 2)" in r.stderr
    os.remove(marker)
