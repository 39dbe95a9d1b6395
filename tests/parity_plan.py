"""What the ``tests/engine/test_ddp_parity*.py`` files share: data slicing, the strategy
lists, job tables and one spawn per file (``parity_helpers`` runs and compares)."""

from __future__ import annotations

import torch

from tests.helpers import dataset, mse
from tests.parity_helpers import Job, failures, spawn_jobs

TOL = 1e-12
WORLD = 2

DP_KINDS = ("ddp", "gs", "gs_items", "zero2", "zero2_items")
ALL_KINDS = DP_KINDS + ("fsdp", "fsdp_items", "local")


def rows(x, y, ctx, step, per_rank=4, sizes=None):
    """This rank's share of step ``step``'s global batch (``per_rank`` rows each, or ``sizes``)."""
    n = sum(sizes) if sizes else per_rank * ctx.world
    xs, ys = x[step * n:(step + 1) * n], y[step * n:(step + 1) * n]
    return ctx.part(xs, sizes), ctx.part(ys, sizes)


def plain_steps(t, ctx, steps, per_rank=4):
    """``steps`` plain training steps on the first rows of ``dataset(n=96)``: this rank's
    rows, the mean loss with its item count, step, record (what most ported tests run
    around the one behaviour they check)."""
    x, y = dataset(n=96)
    rec = {}
    for step in range(steps):
        xb, yb = rows(x, y, ctx, step, per_rank=per_rank)
        t.backward(mse(t(xb), yb), len(xb))
        t.step_and_record(rec, step)
    return rec


def out_record(ctx, out):
    """Per-rank outputs are compared with DDP's, never with one process's whole batch."""
    return "n/a" if ctx.local else out.detach().clone()


def adamw():
    """Weight decay and momentum move a parameter whose gradient is zero, not None."""
    return torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1}


def sgd():
    return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}


def jobs(name, fn, kinds, **kwargs) -> list[Job]:
    """``fn`` under each strategy in ``kinds``, recorded as ``(name, kind)``."""
    return [Job(name, fn, k, tuple(sorted(kwargs.items()))) for k in kinds]


class Spawned:
    """One ``spawn_jobs`` for a test file, run when a test first asks for its results.

    ``plan``: a function returning the file's jobs (called late, so the patterns may be
    defined below it). Jobs known to kill their process go last: each costs one more spawn
    for the jobs after it.
    """

    def __init__(self, plan):
        self._plan, self._results = plan, None

    def results(self) -> dict:
        if self._results is None:
            self._results = spawn_jobs(WORLD, self._plan())
        return self._results

    def check(self, name, kinds, against="ddp") -> None:
        """Every strategy in ``kinds`` recorded what ``against`` did, rank by rank."""
        lines = failures(self.results(), name, kinds, against=against, tol=TOL)
        assert not lines, "\n".join(lines)

    def clear(self) -> None:
        self._results = None
