"""GPU smoke run: every strategy and mode on the GPUs of this machine, then a timing.

    python benchmarks/gpu_smoke.py            # on a machine with CUDA GPUs (NCCL)
    python benchmarks/gpu_smoke.py --dry-run  # its whole plan on the CPU (gloo, 2 ranks)

One worker per visible GPU (``torch.cuda.device_count()``; one GPU runs one worker:
NCCL refuses two ranks on one GPU). Three parts, one table:

1. **Modes** (one ``gradsync.spawn``): ddp, ZeRO 1-3, bf16 (and fp16 where the
   precision exists), bf16/int8/PowerSGD wire compression, DiLoCo and Streaming
   DiLoCo. Each trains a few steps; a second run stops half way, saves through
   ``torch.save`` / ``save_sharded``, loads as a resume on another machine would
   (``torch.load(map_location="cpu", weights_only=True)``: host tensors into the
   device) and continues: its parameters must equal the uninterrupted run's
   bitwise. The exact fp32 modes run in float64 and are compared with one process
   training on every rank's batch (gap <= 1e-12). Replicas are compared by an
   all-gathered checksum, and every mode must have trained: its parameters moved
   0.5 to 4 times as far as one fp32 process's ("moved"; a mode that lost its
   gradients moves by weight decay alone; DiLoCo's outer Nesterov step moves further
   than the inner optimizer alone: 2.41 on one H100, 1.80 on 2 CPU ranks).
2. **The command**: ``gradsync train --strategy zero2`` stopped at step 4 and
   continued to 6 equals an uninterrupted 6-step run bitwise (metrics.jsonl losses);
   ``--workers`` beyond the GPUs is refused in one line.
3. **Timing**, side by side and alternating (median step of each block, 3 blocks):
   torch DDP against ``gradsync.DataParallel``, torch FSDP2 (``fully_shard``)
   against ``gradsync.FullyShardedDataParallel``, on an MLP of 8 x (H x H).

The table is printed last; ``--json PATH`` also writes every number. Exit status 1
when a check failed. ``docs/gpu.md`` holds what it printed on a lent H100.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import gradsync as gs  # noqa: E402
from gradsync import dist as gdist  # noqa: E402
from gradsync.engine.sharded.checkpoint import load_sharded, save_sharded  # noqa: E402
from gradsync.engine.strategy.options import SyncOptions  # noqa: E402
from gradsync.engine.strategy.registry import build_strategy  # noqa: E402
from gradsync.engine.transport import comm  # noqa: E402

STEPS = 8  # per mode: stopped after STEPS // 2 and continued


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x))) + x


class Net(nn.Module):
    """Input layer, three wrapped blocks (ZeRO-3's units), a dropout (the GPU's
    generator must survive a resume), a head."""

    def __init__(self, d: int = 64, dropout: float = 0.1):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, d)
        self.blocks = nn.Sequential(Block(d), Block(d), Block(d))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.drop(self.blocks(torch.tanh(self.inp(x)))))


def modes() -> dict:
    """name -> (strategy, precision, SyncOptions fields, exact in float64)."""
    from gradsync.engine.strategy.registry import PRECISIONS

    table = {
        "ddp": ("ddp", "fp32", {}, True),
        "zero1": ("zero1", "fp32", {}, True),
        "zero2": ("zero2", "fp32", {}, True),
        "zero3": ("zero3", "fp32", {}, True),
        "ddp-bf16": ("ddp", "bf16", {}, False),
        "zero2-bf16": ("zero2", "bf16", {}, False),
        "zero3-bf16": ("zero3", "bf16", {}, False),
        "bf16-wire": ("ddp", "fp32", {"compress": "bf16"}, False),
        "int8": ("ddp", "fp32", {"compress": "int8"}, False),
        "powersgd": ("ddp", "fp32", {"compress": "powersgd:2"}, False),
        "diloco": ("ddp", "fp32", {"method": "diloco", "every": 2}, False),
        "streaming": ("ddp", "fp32", {"method": "streaming-diloco", "every": 2,
                                      "fragments": 2}, False),
    }
    if "fp16" in PRECISIONS:
        table["ddp-fp16"] = ("ddp", "fp16", {}, False)
        table["zero2-fp16"] = ("zero2", "fp16", {}, False)
        table["zero3-fp16"] = ("zero3", "fp16", {}, False)
    return table


# ------------------------------------------------------------------------- part 1: modes
def _batch(step: int, dev, dtype):
    g = torch.Generator().manual_seed(1000 * step + gs.rank())
    n = 3 + gs.rank()  # uneven items per rank
    return (torch.randn(n, 16, generator=g, dtype=dtype).to(dev),
            torch.randn(n, 4, generator=g, dtype=dtype).to(dev))


def _build(mode: str, dev, dtype, dropout: float):
    strategy, precision, sync, _exact = modes()[mode]
    torch.manual_seed(0)
    module = Net(dropout=dropout).to(device=dev, dtype=dtype)
    return build_strategy(module, strategy, precision, torch.optim.AdamW, bucket_cap_mb=0.02,
                          wrap={Block}, sync=SyncOptions(**sync), lr=1e-2)


def _train(strat, first: int, last: int, dev, dtype) -> None:
    for step in range(first, last):
        x, y = _batch(step, dev, dtype)
        loss = nn.functional.mse_loss(strat.model(x).to(dtype), y)
        strat.model.backward(loss, num_items=len(x))
        strat.clip_grad_norm_(1.0)
        strat.optimizer.step()
        strat.after_step(len(x) * gs.world_size())
        strat.zero_grad()


def _flat(strat) -> torch.Tensor:
    state = strat.full_state_dict()  # a collective for ZeRO-3
    return torch.cat([v.detach().double().reshape(-1).cpu() for k, v in sorted(state.items())
                      if v.is_floating_point()])


def _save(strat, path: Path) -> None:
    if strat.checkpoint_target is not None:
        save_sharded(path / "shards", *strat.checkpoint_target)
    state = {"full": strat.full_state_dict(), "optimizer": strat.optimizer_state_dict(),
             "extra": strat.extra_state()}
    if gs.rank() == 0:
        torch.save(state, path / "state.pt")
    # every rank's generators: dropout draws differ between ranks of uneven batches
    torch.save({"rng": torch.get_rng_state(), "device_rng": _device_rng()},
               path / f"rng-{gs.rank()}.pt")
    dist.barrier()


def _load(strat, path: Path) -> None:
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if strat.checkpoint_target is not None:
        load_sharded(path / "shards", *strat.checkpoint_target)
    else:
        strat.load_full_state_dict(state["full"])
        strat.load_optimizer_state_dict(state["optimizer"])
    strat.load_extra_state(state["extra"])
    rng = torch.load(path / f"rng-{gs.rank()}.pt", map_location="cpu", weights_only=True)
    torch.set_rng_state(rng["rng"])
    if rng["device_rng"] is not None:
        torch.cuda.set_rng_state(rng["device_rng"])


def _device_rng():
    return torch.cuda.get_rng_state() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None


def _reference(dev, dtype=torch.float64) -> torch.Tensor:
    """One process on every rank's batch of every step (float64, the same clip)."""
    torch.manual_seed(0)
    model = Net(dropout=0.0).to(device=dev, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        xs, ys = [], []
        for r in range(gs.world_size()):
            g = torch.Generator().manual_seed(1000 * step + r)
            n = 3 + r
            xs.append(torch.randn(n, 16, generator=g, dtype=dtype))
            ys.append(torch.randn(n, 4, generator=g, dtype=dtype))
        x, y = torch.cat(xs).to(dev), torch.cat(ys).to(dev)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return torch.cat([v.detach().reshape(-1).cpu() for k, v in sorted(model.state_dict().items())
                      if v.is_floating_point()])


def modes_job(names: list[str], scratch: str) -> dict:
    dev = gdist.comm_device()
    out = {}
    for mode in names:
        t0 = time.perf_counter()
        try:
            exact = modes()[mode][3]
            dtype = torch.float64 if exact else torch.float32
            dropout = 0.0 if exact else 0.1  # the exact check compares with no dropout
            torch.manual_seed(1)
            if dev.type == "cuda":
                torch.cuda.manual_seed(1)
            whole = _build(mode, dev, dtype, dropout)
            _train(whole, 0, STEPS, dev, dtype)
            final = _flat(whole)
            del whole
            torch.manual_seed(1)
            if dev.type == "cuda":
                torch.cuda.manual_seed(1)
            first = _build(mode, dev, dtype, dropout)
            _train(first, 0, STEPS // 2, dev, dtype)
            path = Path(scratch) / mode
            if gs.rank() == 0:
                path.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            _save(first, path)
            del first
            torch.manual_seed(99)  # the resume must bring the generators back
            second = _build(mode, dev, dtype, dropout)
            _load(second, path)
            _train(second, STEPS // 2, STEPS, dev, dtype)
            resumed = _flat(second)
            mine = torch.tensor([float(final.sum()), float(final.square().sum())],
                                dtype=torch.float64, device=dev)
            everyone = torch.empty(2 * gs.world_size(), dtype=torch.float64, device=dev)
            comm.all_gather_single(everyone, mine, tag="smoke-replicas")
            sums = everyone.view(-1, 2).cpu()
            same = bool((sums == sums[0]).all()) or not second.replicated
            row = {"resume_gap": float((final - resumed).abs().max()),
                   "replicas_identical": same if second.replicated else None,
                   "reference_gap": None, "error": None}
            if exact:
                row["reference_gap"] = float((final - _reference(dev)).abs().max())
            # did it train? how far the parameters moved, against one fp32 process (a
            # mode whose gradients were lost moves by weight decay alone)
            torch.manual_seed(0)
            start = torch.cat([v.detach().double().reshape(-1) for k, v in
                               sorted(Net(dropout=0.0).state_dict().items())
                               if v.is_floating_point()])
            ref = _reference(dev, torch.float32).double()
            row["moved_vs_fp32"] = float((final - start).norm() / (ref - start).norm())
        except Exception as e:  # noqa: BLE001 - one line per mode, every mode tried
            last = traceback.extract_tb(e.__traceback__)[-1]
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]} "
                            f"({Path(last.filename).name}:{last.lineno})"}
        row["seconds"] = time.perf_counter() - t0
        out[mode] = row
    return out


# ------------------------------------------------------------------------- part 2: the command
def command_checks(workers: int, backend: str, scratch: Path) -> dict:
    def train(out: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gradsync", "train", "--workers",
                               str(workers), "--backend", backend, "--strategy", "zero2",
                               "--steps", str(steps), "--global-batch", "16", "--micro-batch",
                               str(max(1, 16 // workers // 2)), "--checkpoint-every", "2",
                               "--eval-every", "0", "--no-report", "--out", out, *extra],
                              capture_output=True, text=True, cwd=scratch,
                              env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))

    def losses(out: str) -> list[float]:
        lines = (scratch / out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    res = {}
    a = train("stopped", 4)
    b = train("stopped", 6) if a.returncode == 0 else a
    c = train("whole", 6)
    if a.returncode or b.returncode or c.returncode:
        bad = next(r for r in (a, b, c) if r.returncode)
        res["resume"] = {"ok": False, "error": (bad.stderr.strip().splitlines() or ["?"])[-1]}
    else:
        res["resume"] = {"ok": losses("stopped") == losses("whole"),
                         "losses": losses("whole")}
    refused = train("refused", 1, "--workers", str(workers + 1)) if backend == "nccl" else \
        subprocess.run([sys.executable, "-m", "gradsync", "train", "--backend", "nccl",
                        "--steps", "1", "--out", "refused"], capture_output=True, text=True,
                       cwd=scratch, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    lines = refused.stderr.strip().splitlines()
    res["refused"] = {"ok": refused.returncode == 2 and len(lines) == 1,
                      "line": lines[-1] if lines else ""}
    return res


# ------------------------------------------------------------------------- part 3: timing
def _mlp(width: int, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def timing_job(width: int, batch: int, steps: int, blocks: int) -> dict:
    dev = gdist.comm_device()
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def make(kind: str):
        module = _mlp(width).to(dev)
        if kind == "torch DDP":
            model = nn.parallel.DistributedDataParallel(module, device_ids=[dev] if cuda
                                                        else None)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None
        if kind == "gradsync DataParallel":
            model = gs.DataParallel(module)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-4), model
        if kind == "torch FSDP2":
            from torch.distributed.fsdp import fully_shard

            for layer in module:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(module)
            return module, torch.optim.AdamW(module.parameters(), lr=1e-4), None
        model = gs.FullyShardedDataParallel(module, wrap={nn.Linear})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), model

    g = torch.Generator().manual_seed(gs.rank())
    x = torch.randn(batch, width, generator=g).to(dev)
    y = torch.randn(batch, width, generator=g).to(dev)
    pairs = [("torch DDP", "gradsync DataParallel"), ("torch FSDP2", "gradsync zero3 (FSDP)")]
    times: dict[str, list[float]] = {k: [] for pair in pairs for k in pair}
    for pair in pairs:
        built = {k: make(k) for k in pair}
        for _ in range(blocks):
            for kind in pair:  # alternating blocks: the same machine state for both
                model, opt, ours = built[kind]
                for i in range(steps + 2):  # 2 warm-up steps per block
                    if i == 2:
                        sync()
                        t0 = time.perf_counter()
                    loss = nn.functional.mse_loss(model(x), y)
                    if ours is not None:
                        ours.backward(loss, num_items=batch)
                    else:
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sync()
                times[kind].append((time.perf_counter() - t0) / steps)
        del built
    return {k: [t * 1e3 for t in v] for k, v in times.items()}


# ------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="the whole plan on the CPU: gloo, 2 ranks, small sizes")
    p.add_argument("--json", default="", help="also write every number to this file")
    p.add_argument("--width", type=int, default=0, help="timing MLP width (default 4096 on "
                   "GPUs, 256 dry)")
    p.add_argument("--skip", default="", help="parts to skip: modes,command,timing")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu_smoke: no CUDA GPU here; --dry-run runs the plan on the CPU", file=sys.stderr)
        return 2
    workers = torch.cuda.device_count() if cuda else 2
    backend = "nccl" if cuda else "gloo"
    width = args.width or (4096 if cuda else 256)
    batch = 512 if cuda else 16
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
                    "workers": workers, "backend": backend, "torch": torch.__version__}
    t_start = time.perf_counter()
    failed = []
    with tempfile.TemporaryDirectory() as scratch:
        if "modes" not in skip:
            t0 = time.perf_counter()
            names = list(modes())
            res = gs.spawn(modes_job, workers, names, scratch, backend=backend, timeout_s=300)
            report["modes"] = res[0]
            report["modes_s"] = time.perf_counter() - t0
            for name, row in res[0].items():
                bad = (row.get("error") or row["resume_gap"] != 0.0
                       or row["replicas_identical"] is False
                       or (row["reference_gap"] is not None and row["reference_gap"] > 1e-12)
                       or not 0.5 <= row["moved_vs_fp32"] <= 4.0)
                if bad:
                    failed.append(f"mode {name}")
        if "command" not in skip:
            t0 = time.perf_counter()
            report["command"] = command_checks(workers, backend, Path(scratch))
            report["command_s"] = time.perf_counter() - t0
            failed += [f"command {k}" for k, v in report["command"].items() if not v["ok"]]
        if "timing" not in skip:
            t0 = time.perf_counter()
            ms = gs.spawn(timing_job, workers, width, batch, 10 if cuda else 2, 3,
                          backend=backend, timeout_s=300)[0]
            report["timing_ms"] = ms
            report["timing_shape"] = {"width": width, "depth": 8, "batch_per_worker": batch}
            report["timing_s"] = time.perf_counter() - t0
    report["total_s"] = time.perf_counter() - t_start
    report["failed"] = failed
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print_table(report)
    return 1 if failed else 0


def print_table(r: dict) -> None:
    print(f"\ngradsync GPU smoke: {r['device']}, {r['workers']} worker(s), {r['backend']}, "
          f"torch {r['torch']}, {r['total_s']:.0f} s")
    if "modes" in r:
        print(f"\n{'mode':<12} {'resume gap':>11} {'vs 1 process':>13} {'replicas':>9} "
              f"{'moved':>6} {'s':>6}  error")
        for name, row in r["modes"].items():
            if row.get("error"):
                print(f"{name:<12} {'':>11} {'':>13} {'':>9} {'':>6} {row['seconds']:6.1f}  "
                      f"{row['error']}")
                continue
            ref = "-" if row["reference_gap"] is None else f"{row['reference_gap']:.1e}"
            rep = {True: "same", False: "DIFFER", None: "local"}[row["replicas_identical"]]
            print(f"{name:<12} {row['resume_gap']:11.1e} {ref:>13} {rep:>9} "
                  f"{row['moved_vs_fp32']:6.2f} {row['seconds']:6.1f}")
    if "command" in r:
        c = r["command"]
        print(f"\ngradsync train --strategy zero2, stopped at 4 and continued to 6 = 6 at "
              f"once: {'yes' if c['resume']['ok'] else 'NO'}"
              + (f" ({c['resume'].get('error')})" if c["resume"].get("error") else ""))
        print(f"too many workers refused in one line: {'yes' if c['refused']['ok'] else 'NO'}"
              f"  [{c['refused']['line']}]")
    if "timing_ms" in r:
        t, shape = r["timing_ms"], r["timing_shape"]
        print(f"\nstep time, ms (MLP 8 x {shape['width']}, batch {shape['batch_per_worker']} "
              "per worker, AdamW; median of 3 alternating blocks)")
        for ref, ours in (("torch DDP", "gradsync DataParallel"),
                          ("torch FSDP2", "gradsync zero3 (FSDP)")):
            a, b = statistics.median(t[ref]), statistics.median(t[ours])
            print(f"  {ref:<12} {a:8.2f}   {ours:<22} {b:8.2f}   ratio {b / a:5.2f}x")
    print("\nall checks passed" if not r["failed"] else f"\nFAILED: {', '.join(r['failed'])}")


if __name__ == "__main__":
    sys.exit(main())
