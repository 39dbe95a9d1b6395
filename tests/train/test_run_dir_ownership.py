"""Issue 34, defect 5 (train): gradsync train writes only into run directories of its own.

At 4ab900c ``gradsync train --out DIR`` over another tool's directory replaced its
``config.json`` and ``metrics.jsonl`` without a word. Now a directory is gradsync's
when it is new or empty, holds the ``gradsync-run.json`` marker (written when a run
first takes it), or is a run of a gradsync from before the marker (its checkpoint,
verified as every checkpoint is, or its gradsync-shaped ``config.json``); anything
else is refused in one line before anything is written, and ``--overwrite`` goes on.
Real CLI, real runs of the tiny model.
"""

import json
import os
import shutil

import pytest

from gradsync.rundir import MARKER
from gradsync.train.checkpoint.guard import RunLock, check_run_dir
from tests.cli_in_process import cli_here
from tests.train.test_guards import TINY

pytestmark = pytest.mark.timeout(180)


def _train(out, capfd, *extra, steps=2):
    return cli_here("train", *TINY, "--steps", str(steps), *extra, "--out", str(out),
                    capfd=capfd)


def _another_tools_directory(path):
    path.mkdir()
    files = {"config.json": json.dumps({"name": "their experiment", "lr": 0.1}),
             "metrics.jsonl": '{"epoch": 1, "accuracy": 0.5}\n', "notes.txt": "keep me"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def test_another_tools_directory_is_refused_and_left_as_it_was(tmp_path, capfd):
    out = tmp_path / "theirs"
    files = _another_tools_directory(out)
    r = _train(out, capfd)
    assert {n: (out / n).read_text() for n in files} == files  # nothing replaced
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert (f"--out {out} holds files gradsync did not write (config.json, metrics.jsonl, "
            "notes.txt)") in lines[0] and "pass --overwrite" in lines[0], lines[0]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # not even a lock left


def test_overwrite_takes_it_and_leaves_the_other_files(tmp_path, capfd):
    out = tmp_path / "theirs"
    files = _another_tools_directory(out)
    r = _train(out, capfd, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "notes.txt").read_text() == files["notes.txt"]
    assert json.loads((out / "config.json").read_text())["global_batch"] == 12
    assert json.loads((out / MARKER).read_text())["format"] == "gradsync-run"
    r = _train(out, capfd, steps=3)  # marked: it continues without the flag
    assert r.returncode == 0 and "continuing from step 2" in r.stdout, r.stderr[-2000:]


def test_runs_are_marked_and_runs_from_before_the_marker_continue(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, capfd).returncode == 0
    assert json.loads((out / MARKER).read_text())["format"] == "gradsync-run"
    old = tmp_path / "old"  # a run of a gradsync from before the marker
    shutil.copytree(out, old)
    (old / MARKER).unlink()
    r = _train(old, capfd, steps=3)
    assert r.returncode == 0 and "continuing from step 2" in r.stdout, r.stderr[-2000:]
    assert (old / MARKER).exists()
    (old / MARKER).unlink()  # before its first checkpoint: its config.json says gradsync
    (old / "checkpoint.pt").unlink()
    r = _train(old, capfd, steps=1)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_directory_of_only_gradsyncs_own_leftovers_is_gradsyncs(tmp_path, capfd):
    out = tmp_path / "run"
    (out / "flight").mkdir(parents=True)  # a run killed before its first file: its lock
    (out / "gradsync.lock").write_text("")  # and the flight records of its ranks
    assert _train(out, capfd, steps=1).returncode == 0


def test_a_directory_left_unused_loses_its_new_marker(tmp_path):
    """A start that fails before its first file: a directory it created is removed, one
    that was there is left as it was (tests/train/test_factory_checks.py, with workers)."""
    out, kept = tmp_path / "run", tmp_path / "kept"
    kept.mkdir()
    check_run_dir(str(out))
    for path, created in ((out, True), (kept, False)):
        lock = RunLock(str(path), created=created).acquire()
        lock.claim()
        assert (path / MARKER).exists()
        lock.release()
    assert not out.exists() and list(kept.iterdir()) == []


def test_a_link_in_the_baselines_place_is_replaced_not_followed(tmp_path, capfd):
    """At 4ab900c a symbolic link at OUT/baseline made --baseline end in a traceback
    (rmtree refuses a link); now the link is removed and the baseline runs in place."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.csv").write_text("their data")
    out = tmp_path / "run"
    out.mkdir()
    (out / "baseline").symlink_to(theirs, target_is_directory=True)
    r = _train(out, capfd, "--baseline", "--baseline-steps", "1", steps=1)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert os.listdir(theirs) == ["data.csv"] and (theirs / "data.csv").read_text() == "their data"
    assert (out / "baseline").is_dir() and not (out / "baseline").is_symlink()
