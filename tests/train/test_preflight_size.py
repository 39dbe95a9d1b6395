"""The free-space preflight counts what a save really writes, and the copy beside it (D3).

One spawn of 2 workers trains each mode for 3 steps and stops with a checkpoint
(a mid-run save, as a periodic one: residuals, outer momentum and, for streaming
DiLoCo, a fragment in flight are all in it); the estimate must be within 10% of
the bytes on disk (``checkpoint.pt`` and the shard directory) for ddp, zero1-3,
diloco, streaming, int8 and powersgd. Then a real checkpoint of about 145 KB
with 140 KiB free must be refused before any worker starts, fresh and resumed
(the free-space figure is faked through ``guard.free_space``; the sizes are real).
"""

import os
import shutil

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.train.checkpoint import guard
from gradsync.train.checkpoint.size import estimate_checkpoint_bytes, on_disk, space_needed
from gradsync.train.launcher.preflight import preflight

MODES = {
    "ddp": {},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "diloco": {"sync": "diloco", "sync_every": 1},
    "streaming": {"sync": "streaming-diloco", "sync_every": 2, "fragments": 2, "sync_delay": 1},
    "int8": {"compress": "int8"},
    "powersgd": {"compress": "powersgd:2"},
    "about-145k": {"model": "tests.train.test_preflight_size:mid32", "optimizer": "sgd"},
}


def mid32() -> nn.Module:
    """16,743 float32 parameters: a 2-worker ddp checkpoint with SGD momentum of ~145 KB."""
    return nn.Sequential(nn.Linear(6, 124), nn.Tanh(), nn.Linear(124, 124), nn.Tanh(),
                         nn.Linear(124, 3))


def _cfg(out: str, **kw) -> gs.TrainConfig:
    base = dict(workers=2, steps=4, global_batch=4, micro_batch=2, eval_every=0, drift_every=0,
                no_report=True, timeout=60, checkpoint_every=0, out=out,
                model="tests.train.factories:wide32", data="tests.train.factories:regression32")
    return gs.TrainConfig(**{**base, **kw})


def _save_every_mode(root: str) -> dict:
    sizes = {}
    for name, kw in MODES.items():
        cfg = _cfg(os.path.join(root, name), **kw)
        gs.train(cfg, faults=gs.FaultInjector().fail_at(None, 3, "stop"))  # saves after step 3
        if torch.distributed.get_rank() == 0:
            sizes[name] = {"estimate": estimate_checkpoint_bytes(cfg.resolved()),
                           "actual": on_disk(cfg.out)}
    return sizes


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    return root, gs.spawn(_save_every_mode, 2, str(root), timeout_s=120)[0]


@pytest.mark.parametrize("mode", [m for m in MODES if m != "about-145k"])
def test_estimate_is_within_10_percent_of_the_bytes_on_disk(saved, mode):
    _, sizes = saved
    est, actual = sizes[mode]["estimate"], sizes[mode]["actual"]
    assert actual > 1_000_000  # about 1 MiB of parameters: the checkpoint is mostly tensors
    assert abs(est - actual) <= 0.10 * actual, (mode, est, actual)


def _refused(cfg, free: int) -> str:
    with pytest.raises(UsageError) as e:
        plan, lock = preflight(cfg.resolved())
        lock.release()
    return str(e.value)


def test_140_kib_free_refuses_a_145_kb_checkpoint_fresh_and_resumed(saved, tmp_path,
                                                                    monkeypatch):
    root, sizes = saved
    actual = sizes["about-145k"]["actual"]
    # the size the probe saw: 145,792 bytes; 151,801 since every rank's RNG state is kept
    assert 140 * 1024 < actual < 155_000, actual
    free = {"bytes": 140 * 1024}
    monkeypatch.setattr(guard, "free_space", lambda path: free["bytes"])
    kw = MODES["about-145k"]
    fresh = _cfg(str(tmp_path / "fresh"), **kw)
    line = _refused(fresh, free["bytes"])
    assert f"--out {fresh.out}: 140.0 KiB free on its device, but a checkpoint needs " \
           "about" in line, line
    assert space_needed(fresh.resolved()) >= 2 * 0.9 * actual  # the new one beside the previous one
    resumed_out = tmp_path / "resumed"
    shutil.copytree(root / "about-145k", resumed_out)
    resumed = _cfg(str(resumed_out), **{**kw, "steps": 6})
    assert 0.9 * actual <= space_needed(resumed.resolved()) <= 1.1 * actual  # the old one's there
    _refused(resumed, free["bytes"])
    free["bytes"] = 2 * actual + 65536  # enough: the same checks pass, the lock is taken
    plan, lock = preflight(resumed.resolved())
    lock.release()
    assert plan.action == "resume" and plan.step == 3
