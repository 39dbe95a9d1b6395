"""The same model as torch DDP: gradsync against DistributedDataParallel, rules 1 to 4.

Every pattern runs under torch's DistributedDataParallel and under gradsync
(``DataParallel`` with plain ``loss.backward()``, DDP's own convention, and with
``backward(loss, num_items=n)`` where every rank holds as many items; ZeRO-2;
``FullyShardedDataParallel``) over the same gloo group, from the same initial
weights and data, in float64, and what each rank ends with -- parameters,
buffers, outputs, ``.grad`` and whether it is None -- must agree to 1e-12
(``tests/parity_helpers.py`` runs and compares). Where a single process on the
whole batch means the same thing, it is compared too.

The DDP compatibility rules checked first:

1. a parameter no rank used in the window keeps ``.grad`` as it was (None after
   ``zero_grad(set_to_none=True)``), so AdamW's weight decay and momentum leave it
   alone; one used on some ranks counts as zero on the others;
2. a gradient already in ``.grad`` before a synchronised backward is kept; only
   the window's own contribution is divided by its global count;
3. ``torch.autograd.grad`` on the model's output (gradient penalties, arXiv
   1704.00028 section 4) is a backward no parameter joins: not an error, and the
   next step stays synchronised;
4. buffers move exactly when DDP moves them: broadcast from rank 0 before the
   first forward after a synchronised grad-enabled forward, eval included
   (``DistributedDataParallel._pre_forward`` / ``require_forward_param_sync``);
5. a rank with no data joins the step whether it ran the forward (NaN loss,
   ``num_items=0``) or skipped it (``backward(None, num_items=0)``).

FSDP's flat units are the granularity of "no gradient": a unit no rank used can
keep no gradient, while a parameter unused inside a used unit necessarily gets a
zero slot (as in torch FSDP1's FlatParameter). FSDP therefore joins the
unused-parameter patterns with ``wrap={nn.Linear}``, where the unused parameters
form whole units, and skips patterns whose forward differs per rank (every rank
must gather the same units, as in torch FSDP).

Rule 5 (a rank with no data): ``test_ddp_parity_empty.py``; patterns ported from
torch's own DDP tests: ``test_ddp_parity_{ported,outputs,control,backward}.py``. Cost: one
spawn per file, every job on its own process group (see ``parity_helpers``). A job that
kills its process (gloo aborts on mismatched collectives) is recorded as such and the
jobs after it continue in a fresh spawn.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tests.helpers import D_IN, D_OUT, dataset, mlp, mse
from tests.parity_helpers import Trainer, failures
from tests.parity_plan import ALL_KINDS, DP_KINDS, Spawned, adamw, jobs, out_record, rows, sgd


# ----------------------------------------------------------------------------- rule 1
class Branchy(nn.Module):
    """``spare`` is never used; ``rare`` only where the pattern says (``use_rare``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(D_IN, 8)
        self.rare = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.head = nn.Linear(8, D_OUT)
        self.use_rare = False
        self.double()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.use_rare:
            h = h + torch.tanh(self.rare(h))
        return self.head(h)


def unused(ctx, group, per_rank=True, freeze=True):
    """Rule 1: AdamW with weight decay after steps where parameters got no gradient.

    ``spare`` is never used; ``rare`` is unused, then used on rank 0 only
    (``per_rank``), then everywhere, then unused again (its AdamW state exists now:
    momentum would move it); ``inp.weight`` is frozen after wrapping for one step
    and unfrozen (``freeze``).
    """
    t = Trainer(ctx, Branchy(), group, adamw(), find_unused=True, wrap={nn.Linear})
    x, y = dataset(n=96)
    users = [(), (0,) if per_rank else (), (0, 1), (), (0, 1), (0, 1)]
    rec = {}
    for step, use in enumerate(users):
        t.module.use_rare = ctx.rank in use
        if freeze and step in (4, 5):
            t.module.inp.weight.requires_grad_(step == 5)
        xb, yb = rows(x, y, ctx, step)
        t.backward(mse(t(xb), yb), len(xb))
        t.step_and_record(rec, step)
    return rec


def test_rule1_unused_and_newly_frozen_parameters_keep_grad_none():
    """DDP leaves .grad None for a parameter no rank used, so AdamW leaves it alone."""
    res = SPAWN.results()
    lines = failures(res, "unused", ["gs", "gs_items", "zero2", "zero2_items"])
    lines += failures(res, "unused/units", ["fsdp", "fsdp_items"])
    assert not lines, "\n".join(lines)


# ----------------------------------------------------------------------------- rule 2
def kept(ctx, group, sizes=None):
    """Rule 2: two synchronised backwards per optimizer step, no no_sync, no zero_grad between.

    DDP's second sync keeps the first one's (identical) gradient: g1 + g2. ``sizes``:
    items per rank of each micro-step (uneven: compared with one process, where
    ``loss1.backward(); loss2.backward()`` gives exactly g1 + g2).
    """
    t = Trainer(ctx, mlp(), group, sgd())
    x, y = dataset(n=96)
    rec = {}
    for step in range(3):
        for micro in range(2):
            s = sizes[micro] if sizes else None
            xb, yb = rows(x, y, ctx, 2 * step + micro, per_rank=6, sizes=s)
            t.backward(mse(t(xb), yb), len(xb))
            rec[f"grad{step}.{micro}"] = t.grads()
        t.step()
        t.zero_grad()
        rec[f"state{step}"] = t.state()
    return rec


UNEVEN_MICRO = ([3, 7], [8, 1])  # items of rank 0, 1 in micro-step 0 and 1


def test_rule2_gradient_already_in_grad_is_kept_not_rescaled():
    """DDP + its optimizer gives g1 + g2; with uneven items, one process gives the same."""
    res = SPAWN.results()
    lines = failures(res, "kept", ["gs", "gs_items", "zero2", "zero2_items", "fsdp",
                                   "fsdp_items", "local"])
    lines += failures(res, "kept/uneven", ["gs_items", "zero2_items", "fsdp_items"],
                      against="local")
    assert not lines, "\n".join(lines)


# ----------------------------------------------------------------------------- rule 3
def critic():
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def penalty(ctx, group):
    """Rule 3: WGAN-GP (arXiv 1704.00028, algorithm 1) and an input-saliency pass.

    ``torch.autograd.grad`` of the critic's output with respect to its input opens
    a backward that no parameter joins; the loss backward then runs through that
    double-backward graph. A saliency map taken before training is the same kind
    of pass on its own.
    """
    t = Trainer(ctx, critic(), group, sgd())
    real_all = dataset(n=64, seed=11)[0]
    fake_all = dataset(n=64, seed=12)[0]
    eps_all = torch.rand(64, 1, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    rec = {}
    x0 = ctx.part(real_all[:8]).clone().requires_grad_(True)
    rec["saliency"] = out_record(ctx, torch.autograd.grad(t(x0).sum(), x0)[0])
    for step in range(3):
        sl = slice(8 + 8 * step, 16 + 8 * step)
        real, fake, eps = ctx.part(real_all[sl]), ctx.part(fake_all[sl]), ctx.part(eps_all[sl])
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        g = torch.autograd.grad(t(x_hat).sum(), x_hat, create_graph=True)[0]
        gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
        loss = t(fake).mean() - t(real).mean() + 10 * gp
        t.backward(loss, len(real))
        t.step_and_record(rec, step)
    return rec


def test_rule3_autograd_grad_on_the_output_is_not_an_error():
    """WGAN-GP trains as under DDP (and as one process: the penalty is a per-row mean)."""
    res = SPAWN.results()
    lines = failures(res, "penalty", ["gs", "gs_items", "zero2", "fsdp", "local"])
    assert not lines, "\n".join(lines)


# ----------------------------------------------------------------------------- rule 4
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(D_IN, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, D_OUT)
        self.double()

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.inp(x))))


def bn_eval(ctx, group):
    """Rule 4: BatchNorm running statistics through training, accumulation and evaluation.

    Each rank's batch differs, so its running statistics drift apart between
    broadcasts; DDP broadcasts rank 0's buffers before the first forward after a
    synchronised grad-enabled forward (train or eval), and not after a no_grad or
    no_sync forward. Outputs of every evaluation and the buffers after each phase
    must be DDP's.
    """
    t = Trainer(ctx, BNNet(), group, sgd())
    x, y = dataset(n=96)
    probe = ctx.part(dataset(n=16, seed=21)[0])
    rec = {}
    cursor = [0]

    def train(tag, micro=1):
        for k in range(micro):
            xb, yb = rows(x, y, ctx, cursor[0], per_rank=6)
            cursor[0] += 1
            with t.no_sync() if k < micro - 1 else contextlib.nullcontext():
                t.backward(mse(t(xb), yb), len(xb), micro_steps=micro)
        t.step()
        t.zero_grad()
        rec[tag] = t.state()

    def evaluate(tag, grad):
        t.eval()
        with torch.set_grad_enabled(grad):
            rec[tag] = out_record(ctx, t(probe))
        rec[tag + "/state"] = t.state()
        t.train()

    train("train0")
    train("train1")
    evaluate("eval0", grad=False)
    evaluate("eval1", grad=False)
    train("accumulate", micro=2)
    evaluate("eval2", grad=True)
    evaluate("eval3", grad=True)
    train("train2")
    evaluate("eval4", grad=False)
    return rec


def test_rule4_buffers_broadcast_exactly_when_ddp_does_eval_included():
    """Every evaluation output and every buffer, rank by rank, as under DDP."""
    res = SPAWN.results()
    lines = failures(res, "bn_eval", ["gs", "gs_items", "zero2", "fsdp", "fsdp_items"])
    assert not lines, "\n".join(lines)


# ----------------------------------------------------------------------------- the spawn
def _plan():
    return (
        jobs("unused", unused, DP_KINDS)
        + jobs("unused/units", unused, ("ddp", "fsdp", "fsdp_items"), per_rank=False,
               freeze=False)
        + jobs("kept", kept, ALL_KINDS)
        + jobs("kept/uneven", kept, ("local", "gs_items", "zero2_items", "fsdp_items"),
               sizes=UNEVEN_MICRO)
        + jobs("bn_eval", bn_eval, ("ddp", "gs", "gs_items", "zero2", "fsdp", "fsdp_items"))
        + jobs("penalty", penalty, ("ddp", "gs", "gs_items", "zero2", "local", "fsdp"))
    )


SPAWN = Spawned(_plan)


@pytest.fixture(autouse=True, scope="module")
def _drop_results():
    yield
    SPAWN.clear()
