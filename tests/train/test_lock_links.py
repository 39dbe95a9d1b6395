"""Issue 34, defect 4: ``gradsync.lock`` can never be turned against the user.

Every ``gradsync train --out RUN``, even one refused right after (here ``--resume
must`` with no checkpoint), opens the lock and rewrites its content. At 4ab900c it
was opened without ``O_NOFOLLOW`` and truncated: a symbolic link planted there
emptied its target. A hard link to someone's file did the same, a FIFO or a
directory there ended in a traceback, and a lock whose content was JSON but not an
object (``[1, 2]``) crashed the "took over a stale lock" note. Real CLI, real files.
"""

import os

import pytest

from tests.cli_in_process import cli_here
from tests.train.test_guards import TINY

pytestmark = pytest.mark.timeout(120)


def _someones(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's work")
    return victim


def _refused(r, *needles):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _train(run, capfd, *extra):
    return cli_here("train", *TINY, "--steps", "1", *extra, "--out", str(run), capfd=capfd)


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path, capfd):
    victim = _someones(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "gradsync.lock").symlink_to(victim)
    r = _train(run, capfd, "--resume", "must")
    assert victim.read_text() == "someone's work"
    _refused(r, f"{run / 'gradsync.lock'} is a symbolic link (to {victim})", "remove it")
    r = _train(run, capfd)  # a run that would train: the same
    assert victim.read_text() == "someone's work"
    _refused(r, "is a symbolic link")


def test_a_hard_linked_lock_is_refused_and_its_other_name_untouched(tmp_path, capfd):
    victim = _someones(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    os.link(victim, run / "gradsync.lock")
    r = _train(run, capfd, "--resume", "must")
    assert victim.read_text() == "someone's work"
    _refused(r, "is a hard link", "remove it")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, capfd, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / "gradsync.lock"
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    _refused(_train(run, capfd, "--resume", "must"), f"{lock}", "not")


def test_a_stale_lock_with_json_that_is_not_an_object_is_taken_over(tmp_path, capfd):
    run = tmp_path / "run"
    run.mkdir()
    (run / "gradsync.lock").write_text("[1, 2]")
    r = _train(run, capfd)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (run / "checkpoint.pt").exists() and not (run / "gradsync.lock").exists()
