"""Patterns from torch's own DDP tests, part 1: plain training, shared and unused
parameters, activation checkpointing (reentrant or not, static graph) and sparse
gradients, each under torch DDP and every gradsync strategy it applies to (float64,
1e-12; how: ``test_ddp_parity.py``). Outputs: ``test_ddp_parity_outputs.py``; control
flow and state: ``test_ddp_parity_control.py``; backward variants:
``test_ddp_parity_backward.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.errors import UsageError
from tests.helpers import D_IN, D_OUT, dataset, mlp, mse
from tests.parity_helpers import Trainer, failures
from tests.parity_plan import (
    ALL_KINDS,
    DP_KINDS,
    WORLD,
    Spawned,
    adamw,
    jobs,
    plain_steps,
    rows,
    sgd,
)

# Patterns from torch's own DDP tests (torch/testing/_internal/distributed/
# distributed_test.py, DistributedTest._DistTestBase, unless another file is named),
# rebuilt at this scale and run under every strategy they apply to.


def baseline(ctx, group):
    """test_DistributedDataParallelCPU (_test_DDP_niter): plain training, equal shards.

    Also the harness's own check: DDP against one process on the whole batch.
    """
    t = Trainer(ctx, mlp(), group, sgd())
    return plain_steps(t, ctx, 4, per_rank=6)


class SharedBias(nn.Module):
    """test_ddp_shared_grad_acc_unused_params' ToyModel: ``net1.bias`` is ``self.bias``.

    ``net1`` and the shared bias take no part in the output (a scalar).
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.net1 = nn.Linear(D_IN, 5, bias=False)
        self.bias = nn.Parameter(torch.randn(5))  # not zero: weight decay must show
        self.net1.bias = self.bias
        self.net2 = nn.Linear(D_IN, 5)
        self.double()

    def forward(self, x):
        return self.net2(x).sum()


def shared(ctx, group):
    """test_ddp_shared_grad_acc_unused_params: unused parameters sharing one accumulator."""
    t = Trainer(ctx, SharedBias(), group, adamw(), find_unused=True, wrap={nn.Linear})
    x, y = dataset(n=96)
    rec = {}
    for step in range(4):
        xb, _ = rows(x, y, ctx, step)
        loss = t(xb) / 10 / (ctx.world if ctx.local else 1)  # DDP averages per-rank sums
        t.backward(loss, len(xb))
        t.step_and_record(rec, step)
    return rec


class CheckpointTwiceShared(nn.Module):
    """test_c10d_common.py CheckpointTwiceModuleWeightSharing, non-reentrant.

    ``l1.weight`` is ``l2.weight`` and ``l2`` runs twice under activation
    checkpointing: one parameter used three times in one forward.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(10)
        self.inp = nn.Linear(D_IN, 8)
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.l1.weight = self.l2.weight
        self.head = nn.Linear(8, D_OUT)
        self.double()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.l1(torch.tanh(self.inp(x)))
        h = checkpoint(self.l2, torch.tanh(h), use_reentrant=False)
        h = checkpoint(self.l2, torch.tanh(h), use_reentrant=False)
        return self.head(torch.tanh(h))


def used_twice(ctx, group):
    """test_c10d_common.py test_ddp_checkpointing_weight_sharing / _twice_non_static_graph."""
    t = Trainer(ctx, CheckpointTwiceShared(), group, sgd())
    return plain_steps(t, ctx, 3)


class ReentrantTwice(nn.Module):
    """test_c10d_common.py test_ddp_checkpointing_twice (static graph): a block under
    *reentrant* checkpointing, run twice, so each of its parameters receives its
    gradient twice in one backward (each checkpointed segment runs a backward of its own).
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(12)
        self.inp = nn.Linear(D_IN, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, D_OUT)
        self.double()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=True)
        h = checkpoint(self.block, torch.tanh(h), use_reentrant=True)
        return self.head(h)


class ReentrantOnce(ReentrantTwice):
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, torch.tanh(self.inp(x)), use_reentrant=True))


def reentrant_twice(ctx, group, twice=True):
    """Static graph: the first step counts the arrivals, the next ones overlap again.
    ``twice=False``: the block once, under reentrant checkpointing; stage 3 makes it a
    unit of its own."""
    t = Trainer(ctx, ReentrantTwice() if twice else ReentrantOnce(), group, adamw(),
                static_graph=twice, wrap={nn.Sequential})
    return plain_steps(t, ctx, 4)


def reentrant_in_root_unit(ctx, group):
    """Stage 3 with the checkpointed block inside the root unit: the unit's gradient
    arrives twice (the block's own backward, then the rest's), which is refused by name."""
    t = Trainer(ctx, ReentrantOnce(), group, sgd())
    x, y = dataset(n=96)
    xb, yb = rows(x, y, ctx, 0)
    try:
        t.backward(mse(t(xb), yb), len(xb))
    except UsageError as e:
        return {"error": str(e)}
    return {"error": None}


class SparseBag(nn.Module):
    """test_sparse_gradients' SparseGradientModule: an EmbeddingBag with sparse gradients,
    here followed by a dense layer so sparse and dense gradients share a backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(17)
        self.embedding = nn.EmbeddingBag(10, 6, sparse=True)
        self.head = nn.Linear(6, D_OUT)
        self.double()

    def forward(self, ids):
        return self.head(torch.softmax(self.embedding(ids), dim=1))


def sparse_gradients(ctx, group):
    """test_sparse_gradients: DDP all-reduces the sparse gradient; gradsync sums it dense
    (``.grad`` comes back dense, with the same values: compared densified). SGD with
    momentum, which takes either; three steps, under ``no_sync`` once."""
    t = Trainer(ctx, SparseBag(), group, sgd())
    g = torch.Generator().manual_seed(18)
    ids = torch.randint(0, 10, (24, 3), generator=g)
    y = torch.randn(24, D_OUT, generator=g, dtype=torch.float64)
    rec = {}
    for step in range(3):
        xb, yb = rows(ids, y, ctx, step)
        if step == 1:  # two equal halves of this rank's rows (of the whole batch: local)
            h = len(xb) // 2
            with t.no_sync():
                t.backward(mse(t(xb[:h]), yb[:h]), h, micro_steps=2)
            t.backward(mse(t(xb[h:]), yb[h:]), h, micro_steps=2)
        else:
            t.backward(mse(t(xb), yb), len(xb))
        t.step_and_record(rec, step)
    return rec


def test_ported_baseline_training_matches_ddp_and_one_process():
    """test_DistributedDataParallelCPU; DDP itself is checked against one process too."""
    lines = failures(SPAWN.results(), "baseline", ALL_KINDS[1:])
    lines += failures(SPAWN.results(), "baseline", ["ddp"], against="local")
    assert not lines, "\n".join(lines)


def test_ported_shared_parameter_unused():
    """test_ddp_shared_grad_acc_unused_params."""
    SPAWN.check("shared", ["gs", "gs_items", "zero2", "zero2_items", "fsdp", "local"])


def test_ported_parameter_used_three_times_under_checkpointing():
    """test_c10d_common.py test_ddp_checkpointing_weight_sharing."""
    SPAWN.check("used_twice", ALL_KINDS[1:])


def test_ported_reentrant_checkpointing_twice_with_static_graph():
    """test_c10d_common.py test_ddp_checkpointing_twice: static_graph=True."""
    SPAWN.check("reentrant_twice", DP_KINDS[1:] + ("local",))


def test_reentrant_checkpointing_once_on_every_strategy():
    """The block under reentrant checkpointing once; under stage 3 a unit of its own."""
    SPAWN.check("reentrant_once", ALL_KINDS[1:])


def test_reentrant_checkpointing_inside_a_larger_unit_is_refused_by_name():
    ranks = SPAWN.results()[("reentrant_in_root_unit", "fsdp")]
    assert len(ranks) == WORLD
    for rank in ranks:
        assert "received its gradient twice" in rank["error"], rank
        assert "wrap=" in rank["error"] and "use_reentrant=False" in rank["error"]


def test_ported_sparse_gradients():
    """test_sparse_gradients (nn.EmbeddingBag(sparse=True)), accumulated once under no_sync."""
    SPAWN.check("sparse_gradients", ["gs", "gs_items", "zero2", "zero2_items", "fsdp",
                                     "fsdp_items", "local"])


# ----------------------------------------------------------------------------- the spawn
def _plan():
    return (
        jobs("baseline", baseline, ALL_KINDS)
        + jobs("shared", shared, DP_KINDS + ("fsdp", "local"))
        + jobs("used_twice", used_twice, ALL_KINDS)
        + jobs("reentrant_twice", reentrant_twice, DP_KINDS + ("local",))
        + jobs("reentrant_once", reentrant_twice, ALL_KINDS, twice=False)
        + jobs("reentrant_in_root_unit", reentrant_in_root_unit, ("fsdp",))
        + jobs("sparse_gradients", sparse_gradients, ALL_KINDS)
    )


SPAWN = Spawned(_plan)


@pytest.fixture(autouse=True, scope="module")
def _drop_results():
    yield
    SPAWN.clear()
