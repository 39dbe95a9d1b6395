"""`gradsync train --data-parts 2` on 4 workers: each block of 2 reads its own half, exactly.

Real launches through ``gradsync.train()`` (elastic agent, gloo), on the float64 tiny
model and the index-recording regression data (42 samples: parts [0, 21) and [21, 42),
global batch 12, so each part's 6 a step cross its epochs). Checked against a
single-process float64 reference that trains on each step's union of the two parts'
blocks (``PartedStepSampler.part_blocks``):
  * what each worker read: rank r of 4 only indices of part r // 2, and each step's
    samples are exactly the reference's (on 4 workers, and after resuming on 2);
  * the trajectory: every step's loss and the final parameters equal the reference
    to 1e-12 -- uninterrupted on 4 workers, and stopped after step 4 and continued
    on 2 (the per-part positions are global, so the run continues exactly).
"""

import pytest
import torch
import torch.nn.functional as F

import gradsync as gs
from gradsync.data.parted_sampler import PartedStepSampler
from gradsync.rundir import METRICS, read_metrics
from gradsync.train.task.schedule import lr_factor
from tests.train.factories import RECORD_ENV, N, tensors, tiny64

STEPS, GB, MB, LR, PARTS = 8, 12, 3, 0.05, 2


def _cfg(out, workers, **kw):
    base = dict(workers=workers, steps=STEPS, global_batch=GB, micro_batch=MB, lr=LR, warmup=3,
                optimizer="sgd", out=str(out), clip=0.0, checkpoint_every=0, eval_every=0,
                drift_every=0, no_report=True, seed=0, timeout=60, data_parts=PARTS,
                model="tests.train.factories:tiny64", data="tests.train.factories:regression64")
    return gs.TrainConfig(**{**base, **kw})


def _reference():
    """Per step: the union of the parts' blocks, and one process's losses and parameters."""
    sampler = PartedStepSampler(N, GB, PARTS, PARTS, seed=0)
    torch.manual_seed(0)
    model = tiny64()
    x, y = tensors()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, _cfg("-", 4).resolved()))
    blocks, losses = [], []
    for _ in range(STEPS):
        block = [i for part in sampler.part_blocks() for i in part]
        loss = F.mse_loss(model(x[block]), y[block])
        blocks.append(sorted(block))
        losses.append(loss.item())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return blocks, losses, dict(model.state_dict())


def _read(record, seen, workers):
    """Each step's samples from what every rank recorded (a rank reads GB/K a step)."""
    files = sorted(set(record.iterdir()) - seen)
    seen |= set(files)
    by_rank = {int(f.stem.split("rank")[1]): [int(v) for v in f.read_text().split()]
               for f in files}
    assert sorted(by_rank) == list(range(workers))
    for r, got in by_rank.items():  # rank r only ever reads its block's part
        lo, hi = (0, N // 2) if r // (workers // PARTS) == 0 else (N // 2, N)
        assert all(lo <= i < hi for i in got), (r, got)
    per = GB // workers
    return [sorted(i for r in range(workers) for i in by_rank[r][j * per:(j + 1) * per])
            for j in range(len(by_rank[0]) // per)]


def _gap(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.timeout(120)
def test_two_parts_on_four_workers_then_two_equal_one_process_on_the_union(tmp_path,
                                                                          monkeypatch):
    record, seen = tmp_path / "record", set()
    record.mkdir()
    monkeypatch.setenv(RECORD_ENV, str(record))
    blocks, ref_losses, ref_state = _reference()

    gs.train(_cfg(tmp_path / "straight", 4))
    assert _read(record, seen, 4) == blocks
    stop = gs.FaultInjector().fail_at(None, 4, "stop")
    gs.train(_cfg(tmp_path / "resumed", 4), faults=stop)
    assert _read(record, seen, 4) == blocks[:4]
    summary = gs.train(_cfg(tmp_path / "resumed", 2))  # K' = 2: a multiple of P, exact
    assert _read(record, seen, 2) == blocks[4:]
    assert summary["world_sizes"] == [4, 2] and summary["resumed_from"] == 4

    for run in ("straight", "resumed"):
        losses = [m["loss"] for m in read_metrics(str(tmp_path / run / METRICS))[0]]
        gaps = [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
        assert max(gaps) <= 1e-12, (run, gaps)
        state = torch.load(tmp_path / run / "checkpoint.pt", weights_only=False)
        assert _gap(state["model"], ref_state) <= 1e-12, run
        assert state["sampler"]["kind"] == "parted"
    with pytest.raises(gs.UsageError, match="--data-parts was 2, now 1"):  # no launch
        gs.train(_cfg(tmp_path / "resumed", 2, data_parts=1))


def test_parts_that_do_not_divide_the_workers_are_refused_before_they_start(tmp_path):
    with pytest.raises(gs.UsageError, match=r"--data-parts 2 must divide the number of "
                                            r"workers \(3\) and --global-batch \(12\)") as err:
        gs.train(_cfg(tmp_path / "bad", 3, micro_batch=2))  # 12 = 2 x 2 x 3: only P refuses
    assert "\n" not in str(err.value)
