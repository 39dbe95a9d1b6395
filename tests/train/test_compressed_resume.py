"""A compressed run stopped and continued in a new launch is the uninterrupted run, bit
for bit, on the built-in GPT, whose buckets are rebuilt after the first step (its
gradients become ready in another order than its parameters are registered).

The compressor's residuals live per bucket; a continued launch used to start in
registration order and rebuild again, so the saved residuals no longer fitted their
buckets and restarted at zero (the final parameters then differed by 1.5e-3 with
int8, 2.0e-3 with a one-step delay). The checkpoint now carries the rebuilt layout.
"""

import pytest
import torch

import gradsync as gs
from gradsync.train.config.train_config import TrainConfig

GPT = dict(model="gpt", data="pysrc", steps=6, seq_len=32, global_batch=8, micro_batch=4,
           workers=2, checkpoint_every=3, eval_every=0, drift_every=0, no_report=True,
           timeout=60, probe_every=0)


def final_model(out) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.parametrize("delay", [0, 1])
def test_a_stopped_compressed_gpt_run_continues_bit_for_bit(tmp_path, delay):
    cfg = dict(GPT, compress="int8", compress_delay=delay)
    gs.train(TrainConfig(out=str(tmp_path / "straight"), **cfg))
    broken = str(tmp_path / "broken")
    gs.train(TrainConfig(out=broken, **cfg), faults=gs.FaultInjector().fail_at(None, 3, "stop"))
    assert torch.load(tmp_path / "broken" / "checkpoint.pt", weights_only=False)["step"] == 3
    gs.train(TrainConfig(out=broken, **cfg))
    a, b = final_model(tmp_path / "straight"), final_model(tmp_path / "broken")
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert gap == 0.0, f"the continued run is {gap:.3g} from the uninterrupted one"
