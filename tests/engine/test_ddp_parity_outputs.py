"""Patterns from torch's own DDP tests, part 2: what the forward returns -- a dict whose
outputs the loss partly ignores, nested outputs from a namedtuple input, zero-size
outputs and inputs, outputs without grad -- under torch DDP and every gradsync strategy
it applies to (float64, 1e-12; how: ``test_ddp_parity.py``).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from tests.helpers import D_IN, D_OUT, dataset, mse
from tests.parity_helpers import Trainer, failures
from tests.parity_plan import ALL_KINDS, DP_KINDS, Spawned, adamw, jobs, rows, sgd


class TwoLin(nn.Module):
    """UnusedParamTwoLinLayerNet: returns (a(x), b(x)); ``c`` is never used."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, 4, bias=False)
        self.b = nn.Linear(D_IN, 4, bias=False)
        self.c = nn.Linear(5, 5, bias=False)

    def forward(self, x):
        return self.a(x), self.b(x)


class DictOutput(nn.Module):
    """DictOutputModule: {"predictions": (a, b), "loss": ...}."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.module = TwoLin()
        self.double()

    def forward(self, x):
        predictions = self.module(x)
        return {"predictions": predictions, "loss": (predictions[0] + predictions[1]).sum()}


def unused_output(ctx, group):
    """test_output_unused_in_loss_dict_module (_test_output_unused_in_loss).

    No zero_grad between iterations: ``a`` takes part in the loss for two
    iterations and then not, so its ``.grad`` must stay what it was; ``c`` keeps
    None. AdamW steps on the accumulated gradients every iteration.
    """
    t = Trainer(ctx, DictOutput(), group, adamw(), find_unused=True, wrap={nn.Linear})
    x, y = dataset(n=96)
    rec = {}
    for i in range(5):
        xb, _ = rows(x, y, ctx, i)
        a, b = t(xb)["predictions"]
        loss = (a * b).mean() if i < 2 else b.pow(2).mean()
        t.backward(loss, len(xb))
        rec[f"grad{i}"] = t.grads()
        t.step()
        rec[f"state{i}"] = t.state()
    return rec


Pair = collections.namedtuple("Pair", "a b")


class Nested(nn.Module):
    """test_ddp_static_graph_nested_types' NestedOutputModule.

    Fed a namedtuple, as in test_ddp_namedtuple.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(12)
        self.lin = nn.Linear(D_IN, D_OUT, bias=False)
        self.double()

    def forward(self, inp, output_type):
        assert isinstance(inp, Pair), type(inp)
        x = inp.a * inp.b
        if output_type == "tuple":
            return self.lin(x), (self.lin(x), self.lin(x))
        if output_type == "list":
            return [self.lin(x), [self.lin(x), self.lin(x)]]
        return {"a": self.lin(x), "b": {"c": self.lin(x)}}


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out
    return [t for v in values for t in _leaves(v)]


def nested(ctx, group):
    """test_ddp_static_graph_nested_types + test_ddp_namedtuple: nested outputs, tuple input."""
    t = Trainer(ctx, Nested(), group, sgd())
    x, y = dataset(n=96)
    x2 = dataset(n=96, seed=14)[0]
    rec = {}
    for step, kind in enumerate(["tuple", "list", "dict", "tuple"]):
        xb, yb = rows(x, y, ctx, step)
        x2b, _ = rows(x2, y, ctx, step)
        out = t(Pair(xb, x2b), output_type=kind)
        loss = sum(mse(o, yb) for o in _leaves(out))
        t.backward(loss, len(xb))
        t.step_and_record(rec, step)
    return rec


class ZeroWidth(nn.Module):
    """test_ddp_zero_output_features: a Linear with 0 output features inside the model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(16)
        self.net1 = nn.Linear(D_IN, 8)
        self.net2 = nn.Linear(8, 0)
        self.head = nn.Linear(8, D_OUT)
        self.double()

    def forward(self, x):
        h = torch.relu(self.net1(x))
        return torch.cat([self.head(h), self.net2(h)], dim=1)


ZERO_SIZE_ROWS = ([4, 4], [4, 0], [2, 5])  # rank 1 holds 0 rows in step 1


def zero_size(ctx, group):
    """test_ddp_zero_output_features, trained, plus a step where rank 1's batch has 0 rows.

    Plain kinds: loss = sum of squares / 4 per rank (finite on an empty batch, so
    DDP can run it; one process divides by 4 * world). ``*_items``: the mean over
    the rank's rows with ``num_items`` (one process: over all rows).
    """
    t = Trainer(ctx, ZeroWidth(), group, adamw())
    x, y = dataset(n=96)
    rec = {}
    for step, sizes in enumerate(ZERO_SIZE_ROWS):
        xb, yb = rows(x, y, ctx, step, sizes=list(sizes))
        sq = ((t(xb) - yb) ** 2).sum() / D_OUT
        if ctx.items:
            loss = sq / (len(xb) if ctx.local else max(len(xb), 1))
        else:
            loss = sq / (4 * (ctx.world if ctx.local else 1))
        t.backward(loss, len(xb))
        t.step_and_record(rec, step)
    return rec


class DetachedOutputs(nn.Module):
    """test_ddp_returns_tensor_with_no_grad + test_ddp_new_tensor_in_fwd.

    Outputs without grad_fn: a detached tensor and a tensor created in forward.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(18)
        self.fc1 = nn.Linear(D_IN, 8, bias=False)
        self.fc2 = nn.Linear(8, D_OUT, bias=False)
        self.double()

    def forward(self, x, extra=None):
        h = self.fc2(torch.relu(self.fc1(x)))
        y = h.clone()
        h = h.detach()
        new = torch.ones(1, D_OUT, dtype=torch.float64) if extra is None else extra
        return h, y, {"tensor": new}


def no_grad_outputs(ctx, group, find_unused=False):
    t = Trainer(ctx, DetachedOutputs(), group, sgd(), find_unused=find_unused)
    x, y = dataset(n=96)
    rec, extra = {}, None
    for step in range(3):
        xb, yb = rows(x, y, ctx, step)
        h, out, d = t(xb, extra=extra)
        assert not h.requires_grad and d["tensor"].grad_fn is None
        extra = d["tensor"]
        t.backward(mse(h + out, yb) + extra.sum(), len(xb))
        t.step_and_record(rec, step)
    return rec


def test_ported_dict_output_partly_unused_in_loss():
    """test_output_unused_in_loss_dict_module."""
    SPAWN.check("unused_output", ALL_KINDS[1:])


def test_ported_nested_outputs_and_namedtuple_input():
    """test_ddp_static_graph_nested_types, test_ddp_namedtuple."""
    SPAWN.check("nested", ALL_KINDS[1:])


def test_ported_zero_size_outputs_and_inputs():
    """test_ddp_zero_output_features, trained, with an empty input batch on one rank."""
    res = SPAWN.results()
    lines = failures(res, "zero_size", ["gs", "zero2", "fsdp", "local"])
    lines += failures(res, "zero_size", ["gs_items", "zero2_items"], against="local_items")
    assert not lines, "\n".join(lines)


def test_ported_outputs_without_grad():
    """test_ddp_returns_tensor_with_no_grad, test_ddp_new_tensor_in_fwd."""
    lines = failures(SPAWN.results(), "no_grad_outputs", ALL_KINDS[1:])
    lines += failures(SPAWN.results(), "no_grad_outputs/find_unused", ["gs", "gs_items"])
    assert not lines, "\n".join(lines)


# ----------------------------------------------------------------------------- the spawn
def _plan():
    return (
        jobs("unused_output", unused_output, DP_KINDS + ("local",))
        + jobs("nested", nested, ALL_KINDS)
        + jobs("zero_size", zero_size, ("ddp", "gs", "zero2", "fsdp", "local", "gs_items",
                                        "zero2_items", "local_items"))
        + jobs("no_grad_outputs", no_grad_outputs, ALL_KINDS)
        + jobs("no_grad_outputs/find_unused", no_grad_outputs, ("ddp", "gs", "gs_items"),
               find_unused=True)
        # last: FSDP died of SIGSEGV here (a unit prefetched, then skipped by the forward)
        + jobs("unused_output", unused_output, ("fsdp", "fsdp_items"))
    )


SPAWN = Spawned(_plan)


@pytest.fixture(autouse=True, scope="module")
def _drop_results():
    yield
    SPAWN.clear()
