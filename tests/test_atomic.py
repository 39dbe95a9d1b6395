"""gradsync's one atomic writer (``gradsync/atomic.py``): whole files, never through a
link, with the permissions the umask gives, and one line when the disk says no.

Real files: symbolic links planted where a run directory's files go, a writer that
replaces its file with a private 0600 one (as safetensors does), a write that fails
with ENOSPC halfway. ``checkpoint.pt`` (``train/checkpoint.atomic_save``) and the ZeRO
shard files and manifest (``engine/sharded/checkpoint.py``) are written through the
same door, so the checkpoint is tried here too.
"""

import errno
import os
import stat

import pytest
import torch

from gradsync import atomic
from gradsync.atomic import replacing, write_by_name, write_bytes
from gradsync.errors import StorageError
from gradsync.runfiles import MetricsWriter
from gradsync.train.checkpoint.format import atomic_save


def _someones(tmp_path, name="victim.txt"):
    victim = tmp_path / name
    victim.write_text("someone's work")
    return victim


def test_a_link_at_the_target_is_replaced_never_written_through(tmp_path):
    victim = _someones(tmp_path)
    target = tmp_path / "config.json"
    target.symlink_to(victim)
    write_bytes(target, b"{}", "the config")
    assert victim.read_text() == "someone's work"
    assert not target.is_symlink() and target.read_bytes() == b"{}"


def test_a_link_planted_at_the_temporary_name_is_never_opened(tmp_path, monkeypatch):
    """At 4ab900c the temporary name was ``.tmp-PID-NAME`` (predictable), opened with
    ``open(tmp, "wb")``, which follows a link and truncates its target. Now the name
    has a random part, and even a link planted at that very name is not opened."""
    victim = _someones(tmp_path)
    (tmp_path / f".tmp-{os.getpid()}-config.json").symlink_to(victim)  # the old name
    write_bytes(tmp_path / "config.json", b"{}", "the config")
    assert victim.read_text() == "someone's work"
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: "feedbeef")
    (tmp_path / f".tmp-{os.getpid()}-feedbeef-summary.json").symlink_to(victim)
    with pytest.raises(StorageError, match="while writing the summary to"):
        write_bytes(tmp_path / "summary.json", b"{}", "the summary")
    assert victim.read_text() == "someone's work" and not (tmp_path / "summary.json").exists()


def test_the_checkpoint_replaces_a_link_too(tmp_path):
    victim = _someones(tmp_path)
    (tmp_path / "checkpoint.pt").symlink_to(victim)
    atomic_save({"step": 1, "w": torch.ones(3)}, str(tmp_path / "checkpoint.pt"))
    assert victim.read_text() == "someone's work"
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 1


def test_metrics_are_never_appended_through_a_link(tmp_path):
    """metrics.jsonl is appended to in place (O_APPEND), not replaced: a link there is
    refused (O_NOFOLLOW), in one line. At 4ab900c the lines went into the link's target."""
    victim = _someones(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(StorageError, match="a symbolic link is in the way") as e:
        MetricsWriter(str(tmp_path / "metrics.jsonl"))
    assert "\n" not in str(e.value) and victim.read_text() == "someone's work"


def _private_writer(tmp: str) -> None:
    """Writes as safetensors does: a 0600 file of its own, renamed over the name given."""
    own = tmp + ".own"
    fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"weights")
    os.close(fd)
    os.replace(own, tmp)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_get_the_permissions_the_umask_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_bytes(tmp_path / "model.pt", b"x", "the exported model")
        write_by_name(tmp_path / "model.safetensors", "the exported model", _private_writer)
        atomic_save({"step": 1}, str(tmp_path / "checkpoint.pt"))
    finally:
        os.umask(old)
    for name in ("model.pt", "model.safetensors", "checkpoint.pt"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"


def test_a_failed_write_is_one_line_and_leaves_the_old_file(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")
    with pytest.raises(StorageError) as e:
        with replacing(target, "the summary") as f:
            f.write(b"new, half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(e.value) == (f"no space left on device while writing the summary to {target} "
                            "(the previous one is intact)")
    assert e.value.errno == errno.ENOSPC and target.read_text() == "old"
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary file left


def test_a_writer_that_fails_leaves_nothing_behind(tmp_path):
    def failing(tmp):
        _private_writer(tmp)
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(StorageError, match="input/output error"):
        write_by_name(tmp_path / "model.safetensors", "the exported model", failing)
    assert os.listdir(tmp_path) == []
