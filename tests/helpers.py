"""Models, data and single-process references shared by the distributed tests.

Workers run in other processes, so everything here is importable by name and
deterministic from a seed.
"""

from __future__ import annotations

import torch
from torch import nn

D_IN, D_OUT = 6, 3
SHARDED_STEPS = 20
SHARDED_TOL = {"sgd": 1e-12, "adamw": 1e-9}  # sharded vs unsharded, after 20 float64 steps


def mlp(seed: int = 0, hidden: int = 12, depth: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(D_IN, hidden), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.Tanh()]
    layers.append(nn.Linear(hidden, D_OUT))
    return nn.Sequential(*layers).double()


def dataset(n: int = 96, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(n, D_OUT, generator=g, dtype=torch.float64)
    return x, y


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(kind)


def mse(out, y):
    return ((out - y) ** 2).mean()


def even_schedule(steps: int, world: int, per_rank: int, n: int):
    """schedule[step][rank] = [micro-batch index lists]; equal shards, one micro-step."""
    sched = []
    for s in range(steps):
        base = (s * world * per_rank) % n
        sched.append([[[(base + r * per_rank + i) % n for i in range(per_rank)]]
                      for r in range(world)])
    return sched


def reference_train(model: nn.Module, opt_kind: str, schedule, x, y, loss_fn=mse,
                    clip: float | None = None):
    """One process over the whole global batch of every step: the ground truth."""
    opt = make_optimizer(opt_kind, model.parameters())
    for step in schedule:
        idx = [i for rank in step for micro in rank for i in micro]
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def dp_train(dp, opt_kind: str, schedule, x, y, rank: int, loss_fn=mse, use_items: bool = True,
             clip: float | None = None):
    """This rank's side of the same schedule through a gradsync.DataParallel."""
    opt = make_optimizer(opt_kind, dp.parameters())
    for step in schedule:
        micros = step[rank]
        for k, idx in enumerate(micros):
            last = k == len(micros) - 1
            ctx = dp.no_sync() if not last else _null()
            with ctx:
                if not idx:
                    dp.backward(None, num_items=0)
                    continue
                loss = loss_fn(dp(x[idx]), y[idx])
                if use_items:
                    dp.backward(loss, num_items=len(idx))
                else:
                    loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(dp.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in dp.module.parameters()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def max_gap(a, b) -> float:
    """Largest element gap between two equally long, non-empty lists of tensors."""
    a, b = list(a), list(b)
    assert a and len(a) == len(b), f"{len(a)} tensors against {len(b)}"
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


def same_tensors(a, b) -> bool:
    """Equally many tensors, each bitwise equal (a bare zip would stop at the shorter)."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def optimizer_spec(kind: str):
    """(class, kwargs) of ``make_optimizer(kind, ...)``, for wrappers that build the optimizer."""
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    if kind == "adamw":
        return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}
    raise ValueError(kind)


def uneven_schedule(steps: int, world: int, n: int = 96, same_micro_steps: bool = False):
    """Uneven shards, no_sync micro-steps of unequal sizes, sometimes a rank with nothing.

    ``same_micro_steps``: every rank runs as many micro-steps (stage 3 gathers
    parameters in every forward, so all ranks must take part in each one); item
    counts still differ and some micro-steps hold nothing.
    """
    sched, cursor = [], 0
    for s in range(steps):
        step = []
        for r in range(world):
            sizes = [(s + r) % 4 + 1, 0, 2 * r + 1][: 1 + (s + (0 if same_micro_steps else r)) % 3]
            if r == world - 1 and s % 5 == 0:
                sizes = [0] * len(sizes) if same_micro_steps else [0]
            micros = []
            for k in sizes:
                micros.append([(cursor + i) % n for i in range(k)])
                cursor += k
            step.append(micros)
        sched.append(step)
    return sched


def sharded_train(model, opt, schedule, x, y, rank: int, loss_fn=mse, clip=None, on_step=None):
    """This rank's side of ``schedule`` through a sharded model/optimizer pair.

    ``model`` has backward(loss, num_items) and no_sync(); ``opt`` has step/zero_grad.
    ``clip`` calls gradsync.clip_grad_norm_(opt or model).
    """
    import gradsync as gs

    for step in schedule:
        micros = step[rank]
        for k, idx in enumerate(micros):
            ctx = model.no_sync() if k < len(micros) - 1 else _null()
            with ctx:
                if not idx:
                    model.backward(None, num_items=0)
                    continue
                model.backward(loss_fn(model(x[idx]), y[idx]), num_items=len(idx))
        if clip is not None:
            gs.clip_grad_norm_(opt, clip)
        opt.step()
        if on_step is not None:
            on_step()
        opt.zero_grad()


def job_table(*entries) -> dict:
    """``{name: (fn, args)}`` from ``(name, fn, args)`` triples, for :func:`run_jobs`.

    A name given twice is an error: a dict built in a loop would silently keep the last.
    """
    table: dict = {}
    for name, fn, args in entries:
        if name in table:
            raise ValueError(f"job {name!r} is in the table twice")
        table[name] = (fn, tuple(args))
    return table


def run_jobs(jobs: dict) -> dict:
    """Run ``{name: (fn, args)}`` in order on this rank: ``{name: result}``.

    One spawn serves several tests, each of which picks its job by name with
    :func:`job_results`, so adding or reordering jobs cannot hand it another job's result.
    """
    if not isinstance(jobs, dict):
        raise TypeError(f"run_jobs takes {{name: (fn, args)}}, not {type(jobs).__name__}")
    return {name: fn(*args) for name, (fn, args) in jobs.items()}


def job_results(results, name: str) -> list:
    """Per-rank results of job ``name`` from ``gs.spawn(run_jobs, world, jobs)``.

    KeyError (naming the jobs that ran) for a name no job has; an error too when the
    spawn returned nothing or the ranks ran different jobs.
    """
    if not results:
        raise ValueError("no per-rank results: the spawn returned nothing")
    names = list(results[0])
    for rank, res in enumerate(results):
        if list(res) != names:
            raise ValueError(f"rank {rank} ran jobs {list(res)}, rank 0 ran {names}")
    if name not in names:
        raise KeyError(f"no job named {name!r}; the spawn ran {names}")
    return [res[name] for res in results]


class SharedSpawn:
    """One spawn of a test file's named job table per world size, at its first lookup.

    Multi-process start-up dominates these tests on 2 cores, so a file runs all its
    jobs in one ``gs.spawn`` and each test reads its job by name. ``jobs`` is the
    ``{name: (fn, args)}`` table, or a function of the world size returning it.
    """

    def __init__(self, jobs, timeout_s: float | None = None):
        self._jobs, self._timeout_s, self._runs = jobs, timeout_s, {}

    def results(self, name: str, world: int) -> list:
        """Job ``name``'s result on every rank (one per rank, checked)."""
        import gradsync as gs

        if world not in self._runs:
            jobs = self._jobs(world) if callable(self._jobs) else self._jobs
            self._runs[world] = gs.spawn(run_jobs, world, jobs, timeout_s=self._timeout_s)
        res = job_results(self._runs[world], name)
        assert len(res) == world, f"{name}: {len(res)} results from {world} ranks"
        return res


class Tied(nn.Module):
    """Encoder and decoder share one weight, as a language model's embedding and head do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.enc = nn.Linear(D_IN, D_IN, bias=False)
        self.mid = nn.Linear(D_IN, D_IN)
        self.dec = nn.Linear(D_IN, D_IN, bias=False)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(D_IN, D_OUT)
        self.double()

    def forward(self, x):
        return self.out(torch.tanh(self.dec(torch.tanh(self.mid(self.enc(x))))))


class Tiny(nn.Module):
    """Two parameter elements: with 3 ranks, one rank holds only padding."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([0.3], dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor([-0.2], dtype=torch.float64))

    def forward(self, x):
        return (self.a * x[:, :D_OUT] + self.b).tanh()


class ShardOptimizer:
    """An FSDP model's optimizer as ``sharded_train`` expects it: clipping goes through
    the model's gradient shards."""

    def __init__(self, model, opt):
        self.model, self.opt, self.group = model, opt, None

    def grad_shards(self):
        return self.model.grad_shards()

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()


def errors_of(**makers) -> dict:
    """``{name: message}``: each maker's GradsyncError message, or None when it raised
    nothing (bad-input tests collect these on every rank and compare them by name)."""
    import gradsync as gs

    out = {}
    for name, make in makers.items():
        try:
            make()
            out[name] = None
        except gs.GradsyncError as e:
            out[name] = str(e)
    return out
