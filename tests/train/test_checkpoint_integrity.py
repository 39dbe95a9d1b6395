"""A checkpoint is one verified unit: nothing in it is believed before every byte is checked.

Real checkpoints from real 2-worker ZeRO-2 runs (one spawn makes them all: a run
at step 2, the same run continued to step 3, another run with ``--seed 1``), then
damaged the ways a disk, a copy or a person damages them:

* D1: one flipped bit in the pickled ``step`` (3 -> 67) must not make a longer run
  "already finished"; it is a checksum failure;
* D2: the shard directory of another run (same name, intact files), of another
  step of the same run, or with a flipped byte, is refused naming the file;
* D5: junk in ``checkpoint.pt`` (a tensor, a dict, a list, a string, ``step="ten"``,
  a gradsync dict without ``model``, a flipped byte in the pickle) is one line naming
  the file and what is wrong, exit code 2, no traceback -- from ``gradsync train``
  and from the worker entry point torchrun starts (``python -m gradsync.train``).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.cli import main as cli_main
from gradsync.train.checkpoint.unit import read_unit

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "tests.train.factories:tiny32", "--data", "tests.train.factories:regression32",
         "--optimizer", "sgd", "--global-batch", "4", "--micro-batch", "2", "--eval-every", "0",
         "--drift-every", "0", "--no-report", "--timeout", "60", "--strategy", "zero2"]
SHARDS = "checkpoint-shards"


def _make_runs(root: str) -> None:
    base = dict(workers=2, global_batch=4, micro_batch=2, optimizer="sgd", eval_every=0,
                drift_every=0, no_report=True, timeout=60, strategy="zero2",
                model="tests.train.factories:tiny32", data="tests.train.factories:regression32")
    gs.train(gs.TrainConfig(steps=2, out=os.path.join(root, "a"), **base))
    if torch.distributed.get_rank() == 0:
        shutil.copytree(os.path.join(root, "a"), os.path.join(root, "a2"))
    gs.train(gs.TrainConfig(steps=3, out=os.path.join(root, "a"), **base))
    gs.train(gs.TrainConfig(steps=3, seed=1, out=os.path.join(root, "b"), **base))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    gs.spawn(_make_runs, 2, str(root), timeout_s=90)
    return root


def _copy(runs: Path, name: str, dst: Path) -> Path:
    shutil.copytree(runs / name, dst)
    return dst


def _train(capsys, out: Path, steps: int = 10) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = cli_main(["train", *FLAGS, "--steps", str(steps), "--out", str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err.strip().splitlines()


def _one_line(code: int, lines: list[str], *needles: str) -> str:
    assert code == 2, lines
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _flip_pickled_step(path: Path) -> None:
    """Flip bit 6 of the pickled value of ``step`` (a BININT1 after the key): 3 -> 67."""
    data = bytearray(path.read_bytes())
    at = data.find(b"X\x04\x00\x00\x00step")
    assert at > 0
    j = at + 9
    j += 2 if data[j] == ord("q") else 5 if data[j] == ord("r") else 0  # the memo opcode
    assert data[j] == ord("K") and data[j + 1] == 3, data[at:j + 2]
    data[j + 1] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_resumed_run_keeps_its_id_and_its_shards_carry_it(runs):
    a2, a3, b3 = (read_unit(str(runs / n / "checkpoint.pt")) for n in ("a2", "a", "b"))
    assert (a2["step"], a3["step"], b3["step"]) == (2, 3, 3)
    assert a2["run_id"] == a3["run_id"] != b3["run_id"]
    manifest = json.loads((runs / "a" / SHARDS / "step-0000003" / "manifest.json").read_text())
    assert manifest["identity"]["run_id"] == a3["run_id"] and manifest["identity"]["step"] == 3


def test_d1_a_flipped_bit_in_the_step_is_a_checksum_failure_not_a_finished_run(runs, tmp_path,
                                                                               capsys):
    out = _copy(runs, "a", tmp_path / "run")
    _flip_pickled_step(out / "checkpoint.pt")
    code, lines = _train(capsys, out, steps=10)  # before: "already finished (step 67 of 10)"
    line = _one_line(code, lines, f"checkpoint {out / 'checkpoint.pt'} is corrupted",
                     "data.pkl) fails its checksum")
    assert "finished" not in line


def test_d2_shards_of_another_run_with_the_same_name_are_refused(runs, tmp_path, capsys):
    out = _copy(runs, "a", tmp_path / "run")
    step3 = out / SHARDS / "step-0000003"
    shutil.rmtree(step3)
    shutil.copytree(runs / "b" / SHARDS / "step-0000003", step3)  # --seed 1's, intact
    code, lines = _train(capsys, out)
    _one_line(code, lines, f"{step3 / 'manifest.json'} belongs to another run")


def test_d2_shards_of_another_step_of_the_same_run_are_refused(runs, tmp_path, capsys):
    out = _copy(runs, "a", tmp_path / "run")
    step3 = out / SHARDS / "step-0000003"
    shutil.rmtree(step3)
    shutil.copytree(runs / "a2" / SHARDS / "step-0000002", step3)
    code, lines = _train(capsys, out)
    _one_line(code, lines, f"{step3 / 'manifest.json'} is of step 2, but", "is of step 3")


def test_d2_a_flipped_byte_in_a_shard_file_is_named(runs, tmp_path, capsys):
    out = _copy(runs, "a", tmp_path / "run")
    shard = out / SHARDS / "step-0000003" / "shard-00001-of-00002.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, lines = _train(capsys, out)
    _one_line(code, lines, f"{shard} does not match its checksum")


def _gradsync_dict(runs: Path) -> dict:
    return torch.load(runs / "a" / "checkpoint.pt", weights_only=False)


JUNK = {  # name -> (what checkpoint.pt holds, the words that name the problem)
    "tensor": (lambda r: torch.zeros(3), "is not a gradsync checkpoint: it holds a tensor"),
    "dict": (lambda r: {"a": 1}, "is not a gradsync checkpoint: it holds a dict with keys 'a'"),
    "list": (lambda r: [1, 2, 3], "is not a gradsync checkpoint: it holds a list of 3 items"),
    "string": (lambda r: "hello", "is not a gradsync checkpoint: it holds a string"),
    "step-ten": (lambda r: {**_gradsync_dict(r), "step": "ten"},
                 "is damaged: its step is 'ten', not a step number"),
    "no-model": (lambda r: {k: v for k, v in _gradsync_dict(r).items() if k != "model"},
                 "is incomplete: it has no 'model'"),
}


def _write_junk(runs: Path, out: Path, kind: str) -> str:
    """Put junk ``kind`` into ``out/checkpoint.pt``; the words its error must hold."""
    if kind == "flipped-pickle":  # a byte inside the pickle, away from the step
        _copy(runs, "a", out)
        path = out / "checkpoint.pt"
        data = bytearray(path.read_bytes())
        at = data.find(b"tests.train.factories:tiny32")
        assert at > 0
        data[at + 3] ^= 0x01
        path.write_bytes(bytes(data))
        return "data.pkl) fails its checksum"
    out.mkdir()
    make, words = JUNK[kind]
    torch.save(make(runs), out / "checkpoint.pt")
    return words


@pytest.mark.parametrize("kind", [*JUNK, "flipped-pickle"])
def test_d5_junk_in_checkpoint_pt_is_one_line_naming_it(runs, tmp_path, capsys, kind):
    out = tmp_path / "run"
    words = _write_junk(runs, out, kind)
    code, lines = _train(capsys, out)
    _one_line(code, lines, f"checkpoint {out / 'checkpoint.pt'} ", words)


WORKER = """
import contextlib, io, json, os, sys
from gradsync.train.__main__ import main
flags, cases, results = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}
for i, (name, out) in enumerate(cases.items()):
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(int(sys.argv[3]) + i))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([*flags, "--out", out])
    results[name] = [code, err.getvalue()]
print(json.dumps(results))
"""


def test_d1_d2_d5_under_torchrun_one_line_per_rank_and_exit_2(runs, tmp_path):
    """The process torchrun starts (``python -m gradsync.train``'s ``main``), one rank,
    once per damaged run directory, all in one interpreter."""
    cases, words = {}, {}
    for kind in [*JUNK, "flipped-pickle"]:
        out = tmp_path / kind
        words[kind] = _write_junk(runs, out, kind)
        cases[kind] = str(out)
    out = _copy(runs, "a", tmp_path / "d1")
    _flip_pickled_step(out / "checkpoint.pt")
    cases["d1"], words["d1"] = str(out), "data.pkl) fails its checksum"
    out = _copy(runs, "a", tmp_path / "d2")
    shutil.rmtree(out / SHARDS / "step-0000003")
    shutil.copytree(runs / "b" / SHARDS / "step-0000003", out / SHARDS / "step-0000003")
    cases["d2"], words["d2"] = str(out), "manifest.json belongs to another run"
    port = 29000 + os.getpid() % 2000
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps([*FLAGS, "--steps", "10"]),
                        json.dumps(cases), str(port)], capture_output=True, text=True,
                       timeout=150, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(cases)
    for name, (code, err) in results.items():
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (name, code, err)
        assert lines[0].startswith(f"gradsync.train (rank 0): error: checkpoint {cases[name]}") \
            or lines[0].startswith(f"gradsync.train (rank 0): error: {cases[name]}/"), lines[0]
        assert words[name] in lines[0] and "step None" not in err, (name, lines[0])
