"""``--straggler RANK:SPEED`` slows a rank where a slow device is slow: its compute, before
the gradient leaves (issue 37). The sleep comes between each micro-batch's forward and its
backward -- where benchmarks/stragglers_worker.py sleeps -- not after the backward, when
the bucketed all-reduce has already taken the gradient and the other ranks would wait at
a later collective instead of the gradient's.

A real launch through ``gradsync.train()`` of a model that notes, on each rank, when each
forward ended and when its backward reached the output (``tests.train.factories:timed64``,
20 ms of forward a sample).
"""

import gradsync as gs
from tests.train.factories import RECORD_ENV

SPEED = 0.25


def _times(record, rank):
    (f,) = record.glob(f"times-rank{rank}-*.txt")
    rows = [line.split() for line in f.read_text().splitlines()]
    starts = [float(t) for w, t in rows if w == "forward"]
    ends = [float(t) for w, t in rows if w == "forwarded"]
    backs = [float(t) for w, t in rows if w == "backward"]
    # training forwards are those with a backward: the held-out ones (none here) have not
    assert len(starts) == len(ends) == len(backs), rows
    return [(e - s, b - e) for s, e, b in zip(starts, ends, backs)]


def test_the_straggler_sleeps_between_forward_and_backward(tmp_path, monkeypatch):
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv(RECORD_ENV, str(record))
    gs.train(gs.TrainConfig(
        workers=2, steps=3, global_batch=8, micro_batch=2, lr=0.05, warmup=0,
        optimizer="sgd", out=str(tmp_path / "run"), clip=0.0, checkpoint_every=0,
        eval_every=0, no_report=True, seed=0, timeout=60, straggler=f"1:{SPEED}",
        model="tests.train.factories:timed64", data="tests.train.factories:regression64"))
    fast, slow = _times(record, 0), _times(record, 1)
    assert len(fast) == len(slow) == 3 * 2  # 3 steps of 2 micro-batches each
    # rank 0: its backward follows its forward at once
    assert all(gap < 0.5 * fwd for fwd, gap in fast), fast
    # rank 1: between them it sleeps (1/SPEED - 1) = 3 times the micro-batch's compute,
    # at least 3 times its forward (the backward's share is estimated), before any of
    # its gradient exists to be sent
    assert all(gap >= (1 / SPEED - 1) * fwd * 0.9 for fwd, gap in slow), slow
