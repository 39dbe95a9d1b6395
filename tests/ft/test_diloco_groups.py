"""DiLoCo across replica groups: one DiLoCo worker per group, syncs through the quorum.

* No failure, one worker per group: `--ft-groups 2 --sync diloco --sync-every 3`
  ends at the plain `--workers 2 --sync diloco` run's model (float64, 1e-12): the
  same deal of samples, the same item-weighted outer steps (syncs after steps 3,
  6 and the last, 8).
* Two groups of two workers; rank 1 of group 1 SIGKILLed during step 5, between
  the syncs after steps 3 and 6, and restarted by its launcher. Group 0 waits at
  the sync (one group of two is no quorum) without restarting; group 1 resumes
  from its checkpoint, is behind, heals from group 0 at that sync and sums with
  weight 0: the sync after step 6 holds group 0's 18 items and none of group 1's
  lost work. Both end at the same global copy. Before the kill, the step-4 loss
  of the two groups together is the plain run's (the sync after step 3, summed
  in chunks by two ranks per group, is the plain run's sync).
* In process, with a stand-in for torchft's Manager: the outer step divides the
  item-weighted sum by the weights present, a group that contributes nothing
  (healed, joining) adds weight 0, and a sync that does not commit is summed
  again with the next quorum (without the group that was lost), applied once.

The three `gradsync train` runs go side by side (most of their time is start-up
and waiting on each other).
"""

import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.errors import UsageError
from gradsync.rundir import METRICS, read_metrics_file

from .helpers import ROOT, TRAIN, env, max_diff, restarts, step_rows

DILOCO = ["--sync", "diloco", "--sync-every", "3", "--global-batch", "12", "--micro-batch", "2"]


def syncs(run) -> list[dict]:
    return [e for e in read_metrics_file(str(run / METRICS)).events if e.get("event") == "sync"]


def model_of(run) -> dict:
    final = torch.load(run / "checkpoint.pt", weights_only=False)
    assert final["step"] == 8
    return final["model"]


STREAMING = ["--sync", "streaming-diloco", "--fragments", "2", "--sync-every", "4",
             "--sync-delay", "1", "--global-batch", "12", "--micro-batch", "2"]
RUNS = {"plain": ["--workers", "2", *DILOCO], "ft": ["--workers", "1", "--ft-groups", "2", *DILOCO],
        "kill": ["--workers", "2", "--ft-groups", "2", "--max-restarts", "1", *DILOCO],
        "streaming-plain": ["--workers", "2", *STREAMING],
        "streaming-ft": ["--workers", "1", "--ft-groups", "2", *STREAMING]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The five runs, side by side (most of their time is start-up and waiting):
    {name: (output directory, exit code, output)}."""
    tmp = tmp_path_factory.mktemp("diloco")
    procs = {}
    for name, args in RUNS.items():
        extra = {"GRADSYNC_FT_FAULT": "1/1:4:kill"} if name == "kill" else {}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "gradsync", "train", *TRAIN, *args, "--out",
             str(tmp / name)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env(**extra), cwd=ROOT)
    out = {}
    try:
        for name, proc in procs.items():
            text, _ = proc.communicate(timeout=240)
            out[name] = (tmp / name, proc.returncode, text)
    finally:
        for proc in procs.values():
            proc.kill()
    return out


@pytest.fixture(scope="module")
def plain(runs):
    """The plain two-worker DiLoCo run: (final model, step rows)."""
    run, code, text = runs["plain"]
    assert code == 0, text[-4000:]
    return model_of(run), step_rows(run)


def test_one_worker_groups_are_the_plain_diloco_run(runs, plain):
    model, _ = plain
    out, code, text = runs["ft"]
    assert code == 0, text[-4000:]
    for g in (0, 1):
        run = out / f"group-{g}"
        assert max_diff(model_of(run), model) <= 1e-12, g
        got = [(e["step"], e["quorum"], e["weights"]) for e in syncs(run)]
        assert got == [(0, [0, 1], [0.0, 0.0]), (3, [0, 1], [18.0, 18.0]),
                       (6, [0, 1], [18.0, 18.0]), (8, [0, 1], [12.0, 12.0])], got
        assert [r["items"] for r in step_rows(run)] == [6] * 8  # its half of every batch


def test_one_worker_groups_are_the_plain_streaming_diloco_run(runs):
    """Fragment 1 summed after steps 2 and 6, fragment 0 after 4, each applied a step
    later and merged with alpha; the last step sums both and takes the global copy."""
    (plain, code, text), (out, ft_code, ft_text) = runs["streaming-plain"], runs["streaming-ft"]
    assert code == 0, text[-4000:]
    assert ft_code == 0, ft_text[-4000:]
    want = model_of(plain)
    for g in (0, 1):
        run = out / f"group-{g}"
        assert max_diff(model_of(run), want) <= 1e-12, (g, max_diff(model_of(run), want))
        got = [(e["step"], e.get("fragments"), e["weights"]) for e in syncs(run)]
        assert got == [(0, [], []), (2, [1], [12.0, 12.0]), (4, [0], [24.0, 24.0]),
                       (6, [1], [24.0, 24.0]), (8, [0, 1], [[24.0, 24.0], [12.0, 12.0]])], got
        losses = [r["loss"] for r in step_rows(run)]
        assert len(losses) == 8


def test_a_group_killed_between_syncs_adds_nothing_and_heals(runs, plain):
    _, plain_rows = plain
    out, code, text = runs["kill"]
    assert code == 0, text[-4000:]
    assert "injected fault kill on rank 1 at step 5" in text
    g0, g1 = out / "group-0", out / "group-1"
    assert not restarts(g0) and len(restarts(g1)) == 1
    assert max_diff(model_of(g0), model_of(g1)) <= 1e-12
    for run in (g0, g1):
        at = {e["step"]: e for e in syncs(run)}
        assert at[3]["weights"] == [18.0, 18.0]
        assert at[6]["quorum"] == [0, 1] and at[6]["weights"] == [18.0, 0.0], at[6]
        assert at[8]["weights"] == [12.0, 12.0]
    assert syncs(g1)[-2]["healed"] and "healed at step 7" in text
    assert [r["step"] for r in step_rows(g0)] == list(range(1, 9))
    # before the kill: the step-4 losses (on the global copy of the sync after step 3)
    # of both groups' halves make the plain run's step-4 loss
    losses = [next(r["loss"] for r in step_rows(run) if r["step"] == 4) for run in (g0, g1)]
    assert abs(sum(losses) / 2 - plain_rows[3]["loss"]) <= 1e-12


class _Work:
    def wait(self):
        pass


class _Manager:
    """torchft's Manager: allreduce (SUM) adds the other groups' next contribution."""

    def __init__(self, adds: list[torch.Tensor]):
        self.adds, self.steps, self.state = adds, [], {"step": 0, "batches_committed": 0}

    def allreduce(self, tensor, reduce_op=None):
        tensor.add_(self.adds.pop(0))
        return _Work()

    def state_dict(self):
        return dict(self.state)

    def current_step(self):
        return self.state["step"]

    def load_state_dict(self, state):
        self.state = dict(state)
        self.steps.append(state["step"])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def one_process_group():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _moved_group():
    """A one-rank group's DiLoCo whose replica went to start - mine over 4 items."""
    from gradsync.ft.outer_sync import GroupDiLoCo

    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    dl = GroupDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda p: torch.optim.SGD(p, lr=1.0), sync_every=3)
    start = _flat(model)
    mine, theirs = (torch.randn(start.numel(), dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        at = 0
        for p in model.parameters():
            p.sub_(mine[at:at + p.numel()].view_as(p))
            at += p.numel()
    dl.step(num_items=4)
    return model, dl, start, mine, theirs


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


PRESENT = torch.tensor([0.0, 2.0, 0.0, 1.0], dtype=torch.float64)  # group 1: 2 items, present


@pytest.mark.parametrize("contribute", [True, False])
def test_the_outer_step_weights_groups_by_items(one_process_group, contribute):
    model, dl, start, mine, theirs = _moved_group()
    sums = dl.quorum_sum(_Manager([PRESENT, 2.0 * theirs]), 0, 1, 0, 2, 0, contribute)
    assert sums.weights == ([4.0, 2.0] if contribute else [0.0, 2.0])
    assert sums.members == [0, 1]
    dl.apply(sums)
    want = start - ((4 * mine + 2 * theirs) / 6 if contribute else theirs)
    assert float((_flat(model) - want).abs().max()) <= 1e-12


class _Replica:
    """ReplicaGroup's surface for one sync: the first sum does not commit."""

    healed_now, why_not = False, "a peer died"

    def __init__(self, manager):
        self.manager, self.commits, self.sizes = manager, [False, True], [2, 1]

    def begin(self):
        from gradsync.ft.replica import StepQuorum

        return StepQuorum(step=0, size=self.sizes.pop(0), position=0)

    def commit(self):
        return self.commits.pop(0)


def test_a_sync_that_does_not_commit_is_summed_again_without_the_lost_group(one_process_group):
    from types import SimpleNamespace

    from gradsync.ft.local_groups import LocalGroups

    model, dl, start, mine, theirs = _moved_group()
    zeros = torch.zeros_like(theirs)
    manager = _Manager([PRESENT, 2.0 * theirs, torch.zeros(4, dtype=torch.float64), zeros])
    cfg = SimpleNamespace(ft=SimpleNamespace(group=0, groups=2, lighthouse="", timeout=5.0),
                          sync=SimpleNamespace(every=3), run=SimpleNamespace(steps=8))
    sess = SimpleNamespace(strategy=SimpleNamespace(diloco=dl), rank=0, world=1, cfg=cfg,
                           display=None, writer=None, start_step=0)
    groups = LocalGroups(sess, _Replica(manager))
    groups.joined = True
    groups.after_step(3)
    assert manager.steps == [4, 4]  # both quorums asked at the position after step 3
    (sync,) = groups.syncs
    assert (sync["step"], sync["attempts"], sync["quorum"], sync["weights"]) == \
        (3, 2, [0], [4.0, 0.0])
    assert groups.deal_over == (1, 0, [0])  # the next round is dealt over the redo's quorum
    assert float((_flat(model) - (start - mine)).abs().max()) <= 1e-12  # one outer step


def test_both_local_update_methods_are_accepted_across_groups_and_compression_is_not():
    from gradsync.train.config.resolve import check_ft
    from gradsync.train.config.train_config import TrainConfig

    check_ft(TrainConfig(ft_groups=2, sync="diloco"))
    check_ft(TrainConfig(ft_groups=2, sync="streaming-diloco"))
    with pytest.raises(UsageError, match="--compress int8"):
        check_ft(TrainConfig(ft_groups=2, sync="diloco", compress="int8"))


class _Alone(_Manager):
    """A quorum of this one group: the sum is what it brought."""

    def __init__(self):
        super().__init__([])

    def allreduce(self, tensor, reduce_op=None):
        return _Work()


def _streaming_trajectory(group: bool) -> torch.Tensor:
    """Seven inner steps of F = 2, H = 4, tau = 2, alpha 0.5 on one worker: fragment 1's
    sum after step 6 is still pending at the last step (applied, then summed again)."""
    from gradsync.engine.local.streaming import StreamingDiLoCo
    from gradsync.ft.outer_sync import GroupStreamingDiLoCo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kind = GroupStreamingDiLoCo if group else StreamingDiLoCo
    dl = kind(model, inner, lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True),
              sync_every=4, fragments=2, delay=2, alpha=0.5)
    data = torch.randn(7, 5, 3, dtype=torch.float64)
    for s in range(1, 8):
        inner.zero_grad()
        model(data[s - 1]).pow(2).mean().backward()
        inner.step()
        dl.step(num_items=5)
        frags = dl.due(s, s == 7) if group else []
        if frags:
            if s == 7:
                dl.settle()
            dl.apply(dl.quorum_sum(_Alone(), 0, 1, 0, 1, 0, True, frags), s == 7)
    dl.sync_now()
    dl.close()
    return _flat(model)


def test_streaming_across_groups_keeps_the_plain_schedule_to_the_last_step(one_process_group):
    assert torch.equal(_streaming_trajectory(True), _streaming_trajectory(False))
