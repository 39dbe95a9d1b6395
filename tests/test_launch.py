"""spawn(): results by rank, and a failed worker is an error naming it, never a hang."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import gradsync as gs


def _whoami(tag):
    t = torch.ones(1) * (gs.rank() + 1)
    dist.all_reduce(t)
    return {"tag": tag, "rank": gs.rank(), "world": gs.world_size(), "rank_sum": float(t),
            "pid": os.getpid()}


def test_spawn_returns_results_indexed_by_rank():
    results = gs.spawn(_whoami, 3, "x")
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["tag"] == "x" and r["world"] == 3 and r["rank_sum"] == 6.0 for r in results)
    pids = {r["pid"] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids  # three processes, none of them this one


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _fail(kind, pid_dir):
    with open(os.path.join(pid_dir, f"{gs.rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if gs.rank() == 1:
        time.sleep(0.2)  # let the others block inside the collective first
        if kind == "raise":
            raise ValueError("bad batch on purpose")
        if kind == "exit":
            os._exit(3)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # the survivors wait here for the dead rank
    dist.all_reduce(t)
    return True


@pytest.mark.parametrize("kind,expect", [
    ("raise", "ValueError: bad batch on purpose"),
    ("exit", "exited with code 3"),
    ("kill", "killed by signal SIGKILL"),
])
def test_failed_worker_names_rank_and_error_without_hanging(kind, expect, tmp_path):
    with pytest.raises(gs.WorkerFailedError) as info:  # a hang: the 20 s collective timeout
        gs.spawn(_fail, 3, kind, str(tmp_path), timeout_s=20)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("worker rank 1 failed"), str(info.value)
    assert expect in first_line
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "workers left behind"


def test_spawn_rejects_bad_world_size():
    with pytest.raises(gs.UsageError, match="integer >= 1"):
        gs.spawn(_whoami, 0, "x")


def test_init_outside_a_launcher_says_how_to_launch(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(gs.UsageError, match="torchrun"):
        gs.init()


def test_unknown_backend_rejected():
    with pytest.raises(gs.UsageError, match="unknown backend"):
        gs.spawn(_whoami, 1, "x", backend="mpi")


def _env(key):
    return os.environ.get(key), os.environ.get("RANK")


def test_workers_see_the_callers_environment_at_each_launch(monkeypatch):
    """Workers fork from a forkserver started at the first launch; a variable set after
    that still reaches them, and the agent's per-worker variables are not overwritten."""
    gs.spawn(_env, 1, "GRADSYNC_TEST_VALUE")  # the forkserver exists from here on
    monkeypatch.setenv("GRADSYNC_TEST_VALUE", "after-first-launch")
    monkeypatch.setenv("RANK", "99")
    assert gs.spawn(_env, 2, "GRADSYNC_TEST_VALUE") == [("after-first-launch", "0"),
                                                        ("after-first-launch", "1")]


_UNSET_AFTER_START = """
import os, sys
import gradsync as gs
from tests.test_launch import _env

os.environ["GRADSYNC_TEST_VALUE"] = "at-forkserver-start"
first = gs.spawn(_env, 1, "GRADSYNC_TEST_VALUE")  # the forkserver starts with it set
del os.environ["GRADSYNC_TEST_VALUE"]
print(first[0][0], gs.spawn(_env, 2, "GRADSYNC_TEST_VALUE"))
"""


def test_a_variable_the_caller_removed_does_not_reach_later_workers():
    """The forkserver keeps the environment it started with; a variable the caller has
    removed since must not reach the workers of a later launch (it did: a test's
    ``GRADSYNC_NCCL_RULES`` stayed set in every later worker of that process)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _UNSET_AFTER_START], cwd=root, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == \
        "at-forkserver-start [(None, '0'), (None, '1')]", out.stdout


def _sigint_handler_is_pythons_default():
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_workers_raise_keyboard_interrupt_on_sigint_like_any_python_process():
    """The forkserver is started with SIGINT ignored; its workers must not inherit that."""
    assert gs.spawn(_sigint_handler_is_pythons_default, 2) == [True, True]


def test_torch_rendezvous_is_changed_only_while_gradsync_launches():
    """Importing gradsync changes nothing in torch: the faster rendezvous method names are
    in place for the duration of a launch only."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from gradsync import launch as launching

    torch_own = rdzv.get_method_name
    assert torch_own is not launching._caller_name
    with launching._fast_rendezvous_names():
        assert rdzv.get_method_name is launching._caller_name
    assert rdzv.get_method_name is torch_own
