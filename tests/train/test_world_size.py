"""A run continued on another number of workers is the same run: 2 -> 3 -> 2 workers.

Each segment is a real launch of the training loop through ``gradsync.train()``
(elastic agent, gloo, files), stopped cleanly by the fault injector after its
last step's checkpoint, then continued with a different ``workers``. The
dataset records every index each worker is served. Checked against a
single-process float64 reference over the whole global batch of each step:
  * the samples: each step's global batch is the same block of the same stream
    of epochs as one process would take, so no sample is repeated or skipped in
    any epoch (42 samples, global batch 12: steps cross epoch boundaries);
  * the trajectory: every step's loss and the final parameters equal the
    reference to 1e-12 (SGD with momentum, warm-up and cosine schedule).
"""

import pytest
import torch
import torch.nn.functional as F

import gradsync as gs
from gradsync.rundir import METRICS, read_metrics
from gradsync.train.task.schedule import lr_factor
from tests.train.factories import RECORD_ENV, N, tensors, tiny64

STEPS, GB, MB, LR = 12, 12, 2, 0.05
SEGMENTS = [(2, 4), (3, 8), (2, None)]  # (workers, stop after step)


def _cfg(out, strategy, workers):
    return gs.TrainConfig(
        workers=workers, steps=STEPS, global_batch=GB, micro_batch=MB, lr=LR, warmup=3,
        optimizer="sgd", strategy=strategy, out=str(out), clip=0.0, checkpoint_every=0,
        eval_every=0, drift_every=4, no_report=True, seed=0, timeout=60,
        model="tests.train.factories:tiny64", data="tests.train.factories:regression64")


def _stream(length, seed=0):
    out, epoch = [], 0
    while len(out) < length:
        out += torch.randperm(N, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch += 1
    return out[:length]


def _blocks(files, workers):
    """The global batches of one segment, from what each rank recorded, in stream order."""
    by_rank = {int(f.stem.split("rank")[1]): [int(v) for v in f.read_text().split()]
               for f in files}
    assert sorted(by_rank) == list(range(workers))
    per = GB // workers
    counts = {len(v) for v in by_rank.values()}
    assert len(counts) == 1 and counts.pop() % per == 0  # every rank drew whole steps
    blocks = []
    for j in range(len(by_rank[0]) // per):
        blocks.append([by_rank[i % workers][j * per + i // workers] for i in range(GB)])
    return blocks


def _reference(order):
    torch.manual_seed(0)
    model = tiny64()
    x, y = tensors()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    cfg = _cfg("unused", "ddp", 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.resolved()))
    losses = []
    for j in range(STEPS):
        block = order[j * GB:(j + 1) * GB]
        loss = F.mse_loss(model(x[block]), y[block])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, dict(model.state_dict())


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_two_three_two_workers_continue_exactly(tmp_path, monkeypatch, strategy):
    record, out = tmp_path / "record", tmp_path / "run"
    record.mkdir()
    monkeypatch.setenv(RECORD_ENV, str(record))
    seen, order, summary = set(), [], None
    for workers, stop in SEGMENTS:
        faults = gs.FaultInjector().fail_at(None, stop, "stop") if stop else None
        summary = gs.train(_cfg(out, strategy, workers), faults=faults)
        files = sorted(set(record.iterdir()) - seen)
        seen |= set(files)
        blocks = _blocks(files, workers)
        assert len(blocks) == (stop or STEPS) - len(order) // GB
        order += [i for b in blocks for i in b]

    assert summary["world_sizes"] == [2, 3, 2] and summary["resumed_from"] == 8
    assert order == _stream(STEPS * GB)  # K-independent: the stream one process would take
    for e in range(len(order) // N):  # every sample exactly once per epoch
        assert sorted(order[e * N:(e + 1) * N]) == list(range(N))

    ref_losses, ref_state = _reference(order)
    metrics = read_metrics(str(out / METRICS))[0]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["world_size"] for m in metrics] == [2] * 4 + [3] * 4 + [2] * 4
    gaps = [abs(m["loss"] - r) for m, r in zip(metrics, ref_losses)]
    assert max(gaps) <= 1e-12, gaps
    state = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    gap = max(float((state[k] - v).abs().max()) for k, v in ref_state.items())
    assert gap <= 1e-12, gap
