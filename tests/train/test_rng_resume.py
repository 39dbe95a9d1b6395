"""A stopped run continues bit for bit when its randomness differs per rank (issue 33,
item 12): the checkpoint keeps every rank's CPU and device generator
(``rng_by_rank``) and each rank gets its own back. Restoring rank 0's stream on every
rank -- what the checkpoint did before -- gives rank 1 other dropout masks after the
resume, and the weights part from the uninterrupted run's.

(The device generator is the CUDA one on a GPU; here the device is the CPU, so the
CUDA half is exercised by ``benchmarks/gpu_smoke.py``'s stop-and-resume check.)
"""

import torch

import gradsync as gs
from gradsync.rundir import METRICS, read_metrics
from gradsync.train.config.train_config import TrainConfig

CFG = dict(model="tests.train.factories:dropout_per_rank64",
           data="tests.train.factories:regression64", workers=2, steps=6, global_batch=8,
           micro_batch=4, lr=0.05, optimizer="sgd", checkpoint_every=1, eval_every=0,
           drift_every=0, no_report=True, timeout=60)


def test_each_rank_resumes_its_own_random_stream(tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    gs.train(TrainConfig(out=str(straight), **CFG))
    gs.train(TrainConfig(out=str(broken), **CFG), faults=gs.FaultInjector().fail_at(None, 3,
                                                                                     "stop"))
    assert read_metrics(str(broken / METRICS))[0][-1]["step"] == 3
    gs.train(TrainConfig(out=str(broken), **CFG))
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(broken / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    assert len(b["rng_by_rank"]) == 2
    assert not torch.equal(b["rng_by_rank"][0]["cpu"], b["rng_by_rank"][1]["cpu"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert ([m["loss"] for m in read_metrics(str(straight / METRICS))[0]]
            == [m["loss"] for m in read_metrics(str(broken / METRICS))[0]])
