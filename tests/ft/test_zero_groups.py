"""ZeRO stages 1-3 inside replica groups end at the uninterrupted run's model.

Two groups of two workers, `--strategy zero1|zero2|zero3`, float64 SGD with
momentum under the default warm-up (the learning rate changes every step), against
one plain `gradsync train --workers 1` on the whole batch. The batch of 10 deals
3/3/2/2 over the four ranks, so group 0 holds 6 items and group 1 holds 4: a sum
that averaged over groups would show.

* Every rank of a group owns its slice of the gradient (and optimizer state, and
  for zero3 parameters); rank j of both groups sums the same slice across groups.
* At a fresh job's first quorum torchft spreads the heal sources: rank 0 of one
  group heals from the other group while rank 1 is itself a source, so only some
  ranks of each group load a peer's state (each group serves one checkpoint).
* zero2 and zero3 with a worker of group 1 (rank 1, rank 0) SIGKILLed during
  step 4 (zero1 shares zero2's heal path, ZeroOptimizer's, and was run by hand to
  5.6e-17; it left the CI run for time): the launcher restarts that group, both its ranks heal
  from group 0, which waits without restarting. Both groups end within 1e-12 of the
  uninterrupted model (zero1 and zero2 share the heal path, ZeroOptimizer's).
* In process: loading a ZeroOptimizer's shard keeps the LR scheduler in charge of
  the inner optimizer (torch's load_state_dict replaces the param groups; before,
  a healed rank kept the loaded warm-up rate forever: zero2 groups ended 2e-2 off).
* In process, `--find-unused-parameters`: a parameter this group did not use and
  another did is stepped here too (weight decay on a zero gradient), zero2 and zero3.
"""

import re
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs

from .helpers import final_model, max_diff, restarts, run_train, step_rows


@pytest.mark.parametrize("stage, fault", [("zero2", "1/1:3:kill"), ("zero3", "1/0:3:kill")])
def test_zero_groups_end_at_the_uninterrupted_model(tmp_path, straight, stage, fault):
    model, _ = straight
    out = tmp_path / "ft"
    proc, _ = run_train(["--workers", "2", "--ft-groups", "2", "--strategy", stage,
                         "--max-restarts", "1", "--out", str(out)], tmp_path,
                        **({"GRADSYNC_FT_FAULT": fault} if fault else {}))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    for g in (0, 1):  # the first quorum: each group was a heal source for one rank
        assert re.search(rf"\[group {g}\] .*GET /checkpoint/0/", text), (g, text[-3000:])
    diffs = [max_diff(final_model(out / f"group-{g}"), model) for g in (0, 1)]
    assert max(diffs) <= 1e-12, diffs
    assert not restarts(out / "group-0")
    assert [r["step"] for r in step_rows(out / "group-0")] == list(range(1, 9))
    assert all(r["quorum"] == [0, 1] for r in step_rows(out / "group-1"))
    if not fault:
        assert not restarts(out / "group-1")
        return
    assert f"injected fault kill on rank {fault[2]} at step 4" in text
    assert len(restarts(out / "group-1")) == 1
    healed = [r["step"] for r in step_rows(out / "group-1") if r.get("healed")]
    assert healed == [4], healed


@pytest.fixture()
def one_process_group():
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_loaded_zero_shard_follows_the_lr_schedule(one_process_group):
    torch.manual_seed(0)
    model = gs.DataParallel(nn.Linear(3, 2).double())
    opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
    model.backward(model(torch.ones(4, 3, dtype=torch.float64)).pow(2).mean(), num_items=4)
    opt.step()
    saved = opt.state_dict()
    opt.load_state_dict(saved, gather=False)  # a heal: this rank's shard, no collective
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    assert len(opt.state) == len(saved["optimizer"]["state"]) > 0  # the momentum came back


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()

    def forward(self, x):  # this group's samples never take head b; the other group's do
        return self.a(x)


class _Work:
    def wait(self):
        pass


class _OtherGroupUsedEverything:
    """torchft's Manager (SUM): group 1's header says 4 items and every parameter used;
    its gradient adds nothing."""

    def allreduce(self, tensor, reduce_op=None):
        if not hasattr(self, "seen"):
            self.seen = True
            tensor[0] += 4
            tensor[3:] += 1  # group 1's one-hot, then its used flags
        return _Work()


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_parameter_another_group_used_is_stepped_here_too(one_process_group, stage):
    from gradsync.engine.strategy.exact import FullyShardedStrategy, ZeroStrategy
    from gradsync.ft.cross_reduce import cross_reduce

    torch.manual_seed(0)
    net = _TwoHeads()
    kw = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.5}
    if stage == "zero2":
        model = gs.DataParallel(net, find_unused_parameters=True)
        strategy = ZeroStrategy(stage, "fp32", model,
                                gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, **kw))
    else:
        model = gs.FullyShardedDataParallel(net, find_unused_parameters=True)
        strategy = FullyShardedStrategy(stage, "fp32", model,
                                        torch.optim.SGD(model.parameters(), **kw))
    before = strategy.full_state_dict()["b.weight"].clone()
    model.backward(model(torch.ones(6, 3, dtype=torch.float64)).pow(2).mean(), num_items=6)
    sums = cross_reduce(_OtherGroupUsedEverything(), strategy, 6, 1.0, 0, 1, 0, 2)
    assert sums.items == 10 and sums.members == (0, 1)
    strategy.optimizer.step()  # head b: a zero gradient here, decayed as in group 1
    after = strategy.full_state_dict()["b.weight"]
    assert torch.allclose(after, before * (1 - 0.1 * 0.5), rtol=0, atol=1e-15)
