"""More NCCL workers than GPUs is refused before anything starts, naming the fix.

On one H100, ``gradsync train`` (2 workers by default) died with "CUDA error: invalid
device ordinal" on rank 1 (and NCCL refuses two ranks on one GPU anyway: "Duplicate
GPU detected"). The check is the same function preflight and ``gradsync.init`` call.
"""

import pytest

from gradsync.dist import check_local_devices
from gradsync.errors import UsageError


def test_more_workers_than_gpus_is_one_line_naming_the_fix():
    with pytest.raises(UsageError) as e:
        check_local_devices("nccl", 2, gpus=1)
    msg = str(e.value)
    assert "2 workers on this host but 1 GPU(s) visible" in msg and "--workers 1" in msg
    assert "--backend gloo" in msg and "\n" not in msg
    check_local_devices("nccl", 4, gpus=4)  # one each: fine
    check_local_devices("gloo", 8, gpus=0)  # the CPU takes any number


def test_nccl_without_a_gpu_is_refused_by_the_train_command(tmp_path, capfd):
    from tests.cli_in_process import cli_here

    res = cli_here("train", "--backend", "nccl", "--steps", "1", "--out", str(tmp_path / "r"),
                   capfd=capfd)
    assert res.returncode == 2
    assert "needs CUDA GPUs and none is available; use --backend gloo" in res.stderr
