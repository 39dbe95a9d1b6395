"""Every checkpoint gradsync writes is data: it resumes through the weights-only loader.

``gradsync.safeload`` reads every checkpoint and shard with torch's weights-only
unpickler and allow-lists no type of gradsync's own (``GRADSYNC_TYPES`` is empty).
That holds only while every strategy's state is tensors and plain data, so each one
is saved and continued here, every rank loading through the door: ddp, ZeRO 1-3
(shards), bf16 with AdamW (fp32 masters), DiLoCo and streaming DiLoCo, int8 and
PowerSGD (error-feedback residuals), and balanced steps (the balancer's state). One
spawn of 2 ranks runs them all (``gs.train`` inside an existing group: no launcher).
"""

import pytest

import gradsync as gs
from gradsync.safeload import GRADSYNC_TYPES, load, trusted
from gradsync.train.checkpoint.unit import read_unit as read_header

pytestmark = pytest.mark.timeout(300)

BASE = dict(global_batch=8, micro_batch=2, optimizer="sgd", eval_every=0, drift_every=0,
            no_report=True, timeout=60, model="tests.train.factories:tiny32",
            data="tests.train.factories:regression32", checkpoint_every=1, warmup=0)
KINDS = {
    "ddp": {},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "bf16-adamw": {"precision": "bf16", "optimizer": "adamw"},
    "zero2-bf16-adamw": {"strategy": "zero2", "precision": "bf16", "optimizer": "adamw"},
    "diloco": {"sync": "diloco", "sync_every": 2},
    "streaming-diloco": {"sync": "streaming-diloco", "sync_every": 2, "fragments": 2,
                         "sync_delay": 1},
    "int8": {"compress": "int8"},
    "powersgd": {"compress": "powersgd:2"},
    "balanced": {"balance": "auto"},
}


def _save_and_continue(root: str) -> bool:
    """Each kind: 3 steps, then continued to 5 (every rank loads the checkpoint)."""
    assert not trusted()  # nobody opted in: data only
    for name, flags in KINDS.items():
        out = f"{root}/{name}"
        gs.train(gs.TrainConfig(steps=3, out=out, **{**BASE, **flags}))
        gs.train(gs.TrainConfig(steps=5, resume="must", out=out, **{**BASE, **flags}))
    return True


def test_every_kind_of_checkpoint_resumes_as_data_only(tmp_path):
    assert GRADSYNC_TYPES == ()
    assert gs.spawn(_save_and_continue, 2, str(tmp_path), timeout_s=240) == [True, True]
    for name in KINDS:  # every byte verified, every file loaded weights-only: step 5
        assert read_header(str(tmp_path / name / "checkpoint.pt"))["step"] == 5, name
        state = load(str(tmp_path / name / "checkpoint.pt"), f"checkpoint of {name}")
        assert state["step"] == 5, name
