"""Run one training pattern under torch DDP, under each gradsync strategy and on one process.

A switching user must get the same model from gradsync as from
``torch.nn.parallel.DistributedDataParallel``. A pattern is written once against
:class:`Trainer`, which gives every strategy DDP's vocabulary (call, backward,
no_sync, step, zero_grad); the spawn runs it under each strategy (``KINDS``) from
the same initial weights and data, and the test compares, rank by rank, what each
one recorded (parameters, buffers, outputs, ``.grad`` and its None-ness) with
:func:`differences`.

Robustness, so one broken pattern cannot hide the others: every job runs on a
process group of its own whose collectives time out after ``JOB_TIMEOUT_S``; an
exception becomes ``{ERROR: text}`` in that job's result; all ranks meet on the
world group (a longer timeout) before the next job starts, so a rank whose peer
abandoned a collective escapes through the job group's timeout and catches up;
and a job that kills its process (gloo aborts on mismatched collectives) is
recorded as such while the remaining jobs continue in a fresh spawn.
"""

from __future__ import annotations

import contextlib
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ERROR = "error"
NA = "n/a"  # a record this strategy cannot provide (sharded gradients); never compared
JOB_TIMEOUT_S = 20
BUCKET_MB = 0.0005  # several gradient buckets even for tiny models

# ddp: torch DDP. gs: gradsync.DataParallel with plain loss.backward() (DDP's
# convention); *_items: backward(loss, num_items=n). zero2: gs.DataParallel +
# gs.ZeroOptimizer(stage=2). fsdp: gs.FullyShardedDataParallel. local / local_items:
# one process on the whole batch (the pattern picks the loss normalisation).
KINDS = ("ddp", "gs", "gs_items", "zero2", "zero2_items", "fsdp", "fsdp_items",
         "local", "local_items")


@dataclass
class Ctx:
    """Where a pattern runs: this rank of ``world``, or one process on the whole batch."""

    rank: int
    world: int
    kind: str
    local: bool = field(init=False)
    items: bool = field(init=False)

    def __post_init__(self):
        self.local = self.kind.startswith("local")
        self.items = self.kind.endswith("_items")

    def part(self, t: torch.Tensor, sizes=None) -> torch.Tensor:
        """This rank's rows of the global batch ``t`` (all of them on one process).

        ``sizes``: rows per rank (default: equal shares of ``len(t)``).
        """
        if sizes is None:
            share = len(t) // self.world
            sizes = [share] * self.world
        if self.local:
            return t[:sum(sizes)]
        start = sum(sizes[:self.rank])
        return t[start:start + sizes[self.rank]]


class Trainer:
    """One strategy behind DDP's vocabulary; ``module`` stays the unwrapped model."""

    def __init__(self, ctx: Ctx, module: nn.Module, group=None, optimizer=None,
                 find_unused: bool = False, wrap=None, broadcast_buffers: bool = True,
                 static_graph: bool = False):
        import gradsync as gs

        self.ctx, self.kind, self.module = ctx, ctx.kind, module
        self.base = ctx.kind.split("_")[0]
        if self.base == "ddp":
            self.model = nn.parallel.DistributedDataParallel(
                module, process_group=group, find_unused_parameters=find_unused,
                forward_sync_buffers=broadcast_buffers,  # gradsync also syncs at init
                static_graph=static_graph)
        elif self.base in ("gs", "zero1", "zero2"):
            self.model = gs.DataParallel(module, group=group, bucket_cap_mb=BUCKET_MB,
                                         first_bucket_mb=BUCKET_MB,
                                         find_unused_parameters=find_unused,
                                         broadcast_buffers=broadcast_buffers,
                                         static_graph=static_graph)
        elif self.base == "fsdp":
            self.model = gs.FullyShardedDataParallel(module, wrap=wrap, group=group,
                                                     find_unused_parameters=find_unused,
                                                     broadcast_buffers=broadcast_buffers)
        elif self.base == "local":
            self.model = module
        else:
            raise ValueError(f"unknown kind {ctx.kind!r}")
        self.opt = None
        if optimizer is not None:
            cls, kwargs = optimizer
            if self.base in ("zero1", "zero2"):
                self.opt = gs.ZeroOptimizer(self.model, cls, stage=int(self.base[-1]), **kwargs)
            else:
                self.opt = cls(self.model.parameters(), **kwargs)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss, n=None, micro_steps: int = 1, **kwargs) -> None:
        """``loss``: this rank's mean over its ``n`` items.

        Plain kinds divide by ``micro_steps`` as a DDP user accumulating over that
        many equal micro-steps does; ``*_items`` kinds pass ``num_items=n`` instead,
        which means the same when every micro-step holds as many items.
        """
        if self.ctx.items and not self.ctx.local:
            self.model.backward(loss, num_items=n, **kwargs)
        else:
            (loss / micro_steps if micro_steps != 1 else loss).backward(**kwargs)

    def no_sync(self):
        return contextlib.nullcontext() if self.ctx.local else self.model.no_sync()

    def step(self) -> None:
        self.opt.step()

    def step_and_record(self, rec: dict, tag) -> None:
        """Record ``.grad`` as ``grad{tag}``, step, zero_grad, record ``state{tag}``."""
        rec[f"grad{tag}"] = self.grads()
        self.step()
        self.zero_grad()
        rec[f"state{tag}"] = self.state()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @torch.no_grad()
    def state(self) -> dict:
        """Parameters and buffers by their unwrapped names."""
        if self.base == "fsdp":
            return {k: v.clone() for k, v in self.model.full_state_dict().items()}
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def grads(self):
        """``.grad`` of every parameter (None kept as None); NA for sharded strategies."""
        if self.base not in ("ddp", "gs", "local"):
            return NA
        return {n: None if p.grad is None else p.grad.detach().to_dense().clone()
                for n, p in self.module.named_parameters()}


@dataclass(frozen=True)
class Job:
    """``fn(ctx, group, **kwargs)`` under strategy ``kind``, recorded as ``name``."""

    name: str
    fn: object
    kind: str
    kwargs: tuple = ()


def run_jobs_guarded(jobs: list[Job], start: int, outdir: str) -> None:
    """Jobs ``start..`` on this rank, each on its own process group; results go to files.

    Rank 0 names the running job in ``outdir/running`` so the caller knows which
    one a dead process died in; each result is saved as soon as the job ends.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    for i in range(start, len(jobs)):
        job = jobs[i]
        if rank == 0:
            Path(outdir, "running").write_text(str(i))
        group = dist.new_group(timeout=timedelta(seconds=JOB_TIMEOUT_S))
        try:
            result = job.fn(Ctx(rank, world, job.kind), group, **dict(job.kwargs))
        except Exception as exc:  # noqa: BLE001 - reported by the test that owns the job
            tail = "".join(traceback.format_exception(exc)[-3:])[-800:]
            result = {ERROR: f"{type(exc).__name__}: {exc}"[:1500] + "\n" + tail}
        torch.save(result, Path(outdir, f"{i}.{rank}.pt"))
        dist.barrier()  # world group: everyone leaves the job together


def spawn_jobs(world: int, jobs: list[Job]) -> dict:
    """``{(name, kind): [result of rank 0..world-1]}`` for every job.

    A job that kills its process (gloo aborts on mismatched collectives) gets the
    spawn's error as its result, and the jobs after it run in a new spawn: one
    extra spawn per such job, none when nothing dies.
    """
    import gradsync as gs

    keys = [(job.name, job.kind) for job in jobs]
    if not keys or len(set(keys)) != len(keys):
        raise ValueError(f"no jobs, or a (name, kind) twice: {sorted(keys)}")
    out: dict = {}
    with tempfile.TemporaryDirectory() as outdir:
        start = 0
        while start < len(jobs):
            try:
                gs.spawn(run_jobs_guarded, world, jobs, start, outdir)
                break
            except gs.WorkerFailedError as exc:
                running = Path(outdir, "running")
                died = int(running.read_text()) if running.exists() else start
                for r in range(world):
                    torch.save({ERROR: f"the process died: {str(exc)[:2000]}"},
                               Path(outdir, f"{died}.{r}.pt"))
                start = died + 1
        for i, job in enumerate(jobs):
            out[(job.name, job.kind)] = [
                torch.load(Path(outdir, f"{i}.{r}.pt"), weights_only=False)
                for r in range(world)]
    return out


def _describe(v) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    return type(v).__name__


def differences(expected, got, tol: float, path: str = "") -> list[str]:
    """Where ``got`` differs from ``expected`` (nested dicts/lists of tensors, None, numbers)."""
    if (isinstance(expected, str) and expected == NA) or (isinstance(got, str) and got == NA):
        return []
    if isinstance(expected, dict) and isinstance(got, dict):
        out = []
        for k in expected:
            if k not in got:
                out.append(f"{path}/{k}: missing")
            else:
                out += differences(expected[k], got[k], tol, f"{path}/{k}")
        out += [f"{path}/{k}: unexpected" for k in got if k not in expected]
        return out
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(expected) != len(got):
            return [f"{path}: {len(got)} entries, expected {len(expected)}"]
        return [d for i, (a, b) in enumerate(zip(expected, got))
                for d in differences(a, b, tol, f"{path}[{i}]")]
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        if expected.shape != got.shape:
            return [f"{path}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"]
        if expected.numel() == 0:
            return []
        a, b = expected.double(), got.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return [f"{path}: NaN where the reference has none (or the reverse)"]
        gap = float((a - b).nan_to_num().abs().max())
        return [f"{path}: max |diff| {gap:.3e}"] if gap > tol else []
    if expected is None or got is None or type(expected) is not type(got):
        if expected is None and got is None:
            return []
        return [f"{path}: {_describe(got)}, expected {_describe(expected)}"]
    return [] if expected == got else [f"{path}: {got!r}, expected {expected!r}"]


def failures(results: dict, name: str, kinds, against: str = "ddp", tol: float = 1e-12,
             max_lines: int = 4) -> list[str]:
    """One line per strategy in ``kinds`` whose records differ from ``against``'s.

    KeyError for a (name, kind) that no job recorded; ``kinds`` must name one at least.
    """
    assert kinds, "nothing to compare"
    ref = results[(name, against)]
    bad = [r for r, v in enumerate(ref) if isinstance(v, dict) and ERROR in v]
    if bad:
        return [f"reference {against} raised on rank {bad[0]}: {ref[bad[0]][ERROR]}"]
    lines = []
    for kind in kinds:
        got = results[(name, kind)]
        if len(got) != len(ref):
            lines.append(f"{kind}: {len(got)} ranks recorded, {against}: {len(ref)}")
            continue
        for r, (e, g) in enumerate(zip(ref, got)):
            if isinstance(g, dict) and ERROR in g:
                lines.append(f"{kind}: rank {r} raised {g[ERROR]}")
                break
            diffs = differences(e, g, tol)
            if diffs:
                where = list(dict.fromkeys(d.split(":")[0].split("/")[1] for d in diffs))
                more = (f" (+{len(diffs) - max_lines} more; records differing: "
                        f"{', '.join(where)})" if len(diffs) > max_lines else "")
                lines.append(f"{kind} vs {against}, rank {r}: " + "; ".join(diffs[:max_lines])
                             + more)
                break
    return lines
