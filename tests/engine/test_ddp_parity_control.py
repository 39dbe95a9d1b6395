"""Patterns from torch's own DDP tests, part 3: control flow the same or different across
ranks, per-rank layers inside a no_sync window, inference on one rank, requires_grad
toggled after wrapping, no_sync accumulation, a buffer rank 0 reassigns -- under torch
DDP and every gradsync strategy it applies to (float64, 1e-12; how: ``test_ddp_parity.py``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tests.helpers import D_IN, D_OUT, dataset, mlp, mse
from tests.parity_helpers import Trainer, failures
from tests.parity_plan import ALL_KINDS, DP_KINDS, Spawned, adamw, jobs, out_record, rows, sgd


class ControlFlow(nn.Module):
    """ControlFlowToyModel: ``lin2`` only for an all-ones input (and, if ``rank_gate`` is
    set, only on that rank: test_ddp_control_flow_different_across_ranks' ToyModel)."""

    def __init__(self, rank_gate=None, rank=0):
        super().__init__()
        torch.manual_seed(13)
        self.lin1 = nn.Linear(D_IN, D_IN, bias=False)
        self.lin2 = nn.Linear(D_IN, D_IN, bias=False)
        self.use_lin2 = lambda: rank_gate is None or rank == rank_gate
        self.double()

    def forward(self, x):
        h = torch.relu(self.lin1(x))
        if torch.equal(x, torch.ones_like(x)) and self.use_lin2():
            return self.lin2(h)
        return h


def control_flow(ctx, group, per_rank=False):
    """test_ddp_control_flow_same_across_ranks (and _different_across_ranks with ``per_rank``).

    Random input on even iterations, all ones on odd ones, which use ``lin2``;
    AdamW: an iteration without ``lin2`` must leave it where it is.
    """
    model = ControlFlow(rank_gate=1 if per_rank else None, rank=ctx.rank)
    t = Trainer(ctx, model, group, adamw(), find_unused=True, wrap={nn.Linear})
    x, _ = dataset(n=96)
    rec = {}
    for i in range(5):
        xb = rows(x, x, ctx, i)[0]
        if i % 2:
            xb = torch.ones_like(xb)
        t.backward(((t(xb) - 0.5) ** 2).mean(), len(xb))
        t.step_and_record(rec, i)
    return rec


class Conditional(nn.Module):
    """test_grads_same_across_ranks_with_no_sync's SimpleConditionalModel.

    Rank 0 uses nn1 then nn2, other ranks nn3 then nn4, alternating per forward.
    """

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(14)
        self.rank, self.state = rank, 0
        self.nn1, self.nn2, self.nn3, self.nn4 = (nn.Linear(1, 1) for _ in range(4))
        self.double()

    def forward(self, x):
        first, self.state = self.state == 0, 1 - self.state
        if self.rank == 0:
            return self.nn1(x) if first else self.nn2(x)
        return self.nn3(x) if first else self.nn4(x)


def conditional_no_sync(ctx, group):
    """test_grads_same_across_ranks_with_no_sync: per-rank layers inside one no_sync window.

    Every layer is used by some rank in the window, so no ``.grad`` is None and all
    ranks hold the same gradients; then AdamW steps.
    """
    t = Trainer(ctx, Conditional(ctx.rank), group, adamw(), find_unused=True)
    g = torch.Generator().manual_seed(15 + ctx.rank)
    rec = {}
    for step in range(2):
        for k in range(2):
            xb = torch.rand(3, 1, generator=g, dtype=torch.float64)
            target = torch.rand(3, 1, generator=g, dtype=torch.float64)
            with t.no_sync() if k == 0 else contextlib.nullcontext():
                t.backward(mse(t(xb), target), len(xb), micro_steps=2)
        t.step_and_record(rec, step)
    return rec


def inference_one_rank(ctx, group):
    """test_ddp_inference: only rank 0 evaluates (grad enabled, as there), rank 1 runs a
    no_grad forward in train mode; training before and after must be unaffected."""
    t = Trainer(ctx, mlp(), group, sgd())
    x, y = dataset(n=96)
    rec = {}
    for step in range(3):
        if step == 1:
            if ctx.rank == 0:
                t.eval()
                rec["eval"] = [out_record(ctx, t(x[:5])) for _ in range(3)]
                t.train()
            elif not ctx.local:
                with torch.no_grad():
                    t(x[:5])
        xb, yb = rows(x, y, ctx, step)
        t.backward(mse(t(xb), yb), len(xb))
        t.step_and_record(rec, step)
    if ctx.local or ctx.rank != 0:
        rec["eval"] = "n/a"
    return rec


class PartlyFrozen(nn.Module):
    """test_ddp_build_debug_param_to_name_mapping_requires_grad: ``lin1.bias`` is frozen
    before wrapping (not tracked); ``lin2.weight`` is toggled after wrapping."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(17)
        self.lin1 = nn.Linear(D_IN, 8)
        self.lin2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, D_OUT)
        self.lin1.bias.requires_grad_(False)
        self.double()

    def forward(self, x):
        return self.head(torch.tanh(self.lin2(torch.tanh(self.lin1(x)))))


def toggled(ctx, group):
    """requires_grad switched off after wrapping for two steps, then on again (AdamW)."""
    t = Trainer(ctx, PartlyFrozen(), group, adamw(), find_unused=True)
    x, y = dataset(n=96)
    rec = {}
    for step in range(5):
        t.module.lin2.weight.requires_grad_(step not in (1, 2))
        xb, yb = rows(x, y, ctx, step)
        t.backward(mse(t(xb), yb), len(xb))
        t.step_and_record(rec, step)
    return rec


def accumulate(ctx, group, steps=False):
    """test_accumulate_gradients_no_sync: a no_grad forward under no_sync first, then
    windows of two micro-steps (no_sync, then synchronised).

    As there, no zero_grad between windows and gradients compared after each
    micro-step (``steps=False``); with ``steps=True``, an SGD step and zero_grad
    after each window (the ZeRO-2 and FSDP form).
    """
    t = Trainer(ctx, mlp(), group, sgd() if steps else None)
    x, y = dataset(n=96)
    with torch.no_grad(), t.no_sync():
        t(ctx.part(x[:8]))
    rec = {}
    for i in range(6):
        xb, yb = rows(x, y, ctx, i)
        with t.no_sync() if i % 2 == 0 else contextlib.nullcontext():
            t.backward(mse(t(xb), yb), len(xb), micro_steps=2)
        if i % 2:
            rec[f"grad{i}"] = t.grads()
            if steps:
                t.step()
                t.zero_grad()
                rec[f"state{i}"] = t.state()
    return rec


class WithBuffer(nn.Module):
    """test_ddp_broadcast_buffer's NetWithBuffers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(19)
        self.a = nn.Linear(D_IN, 8, bias=False)
        self.b = nn.Linear(8, D_OUT, bias=False)
        self.register_buffer("buffer", torch.randn(1, 2, dtype=torch.float64))
        self.double()

    def forward(self, x):
        return self.b(self.a(x)) + self.buffer.sum()


def reassigned_buffer(ctx, group):
    """test_ddp_broadcast_buffer: rank 0 *replaces* its buffer before each forward
    (``module.buffer = module.buffer + 1``); every rank must use rank 0's new one."""
    t = Trainer(ctx, WithBuffer(), group, sgd())
    x, y = dataset(n=96)
    rec = {}
    for step in range(3):
        if ctx.rank == 0:
            t.module.buffer = t.module.buffer + 1
        xb, yb = rows(x, y, ctx, step)
        out = t(xb)
        rec[f"out{step}"] = out_record(ctx, out)
        t.backward(mse(out, yb), len(xb))
        t.step()
        t.zero_grad()
        rec[f"state{step}"] = t.state()
    return rec


def test_ported_control_flow_same_across_ranks():
    """test_ddp_control_flow_same_across_ranks."""
    SPAWN.check("control_flow", ["gs", "gs_items", "zero2", "zero2_items", "fsdp",
                                 "fsdp_items", "local"])


def test_ported_control_flow_different_across_ranks():
    """test_ddp_control_flow_different_across_ranks, test_grads_same_across_ranks_with_no_sync."""
    lines = failures(SPAWN.results(), "control_flow/per_rank", DP_KINDS[1:])
    lines += failures(SPAWN.results(), "conditional_no_sync", DP_KINDS[1:])
    assert not lines, "\n".join(lines)


def test_ported_inference_on_one_rank_only():
    """test_ddp_inference."""
    SPAWN.check("inference_one_rank", DP_KINDS[1:] + ("local",))


def test_ported_requires_grad_toggled_after_wrapping():
    """test_ddp_build_debug_param_to_name_mapping_requires_grad, then toggled after wrapping."""
    SPAWN.check("toggled", DP_KINDS[1:] + ("local",))


def test_ported_accumulate_gradients_no_sync():
    """test_accumulate_gradients_no_sync."""
    lines = failures(SPAWN.results(), "accumulate", ["gs", "gs_items", "local"])
    lines += failures(SPAWN.results(), "accumulate/steps", ALL_KINDS[1:])
    assert not lines, "\n".join(lines)


def test_ported_reassigned_buffer_broadcast_from_rank0():
    """test_ddp_broadcast_buffer."""
    SPAWN.check("reassigned_buffer", ["gs", "gs_items", "zero2", "fsdp"])


# ----------------------------------------------------------------------------- the spawn
def _plan():
    return (
        jobs("control_flow", control_flow, ALL_KINDS)
        + jobs("control_flow/per_rank", control_flow, DP_KINDS, per_rank=True)
        + jobs("conditional_no_sync", conditional_no_sync, DP_KINDS)
        + jobs("inference_one_rank", inference_one_rank, DP_KINDS + ("local",))
        + jobs("toggled", toggled, DP_KINDS + ("local",))
        + jobs("accumulate", accumulate, ("ddp", "gs", "gs_items", "local"))
        + jobs("accumulate/steps", accumulate, ALL_KINDS, steps=True)
        + jobs("reassigned_buffer", reassigned_buffer, ("ddp", "gs", "gs_items", "zero2", "fsdp"))
    )


SPAWN = Spawned(_plan)


@pytest.fixture(autouse=True, scope="module")
def _drop_results():
    yield
    SPAWN.clear()
