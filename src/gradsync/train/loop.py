"""The training loop every worker runs, under `gradsync train` or `torchrun -m gradsync.train`.

Each optimizer step draws ``accumulation`` micro-batches per worker from an
``exact``-mode DistributedSampler (every sample once per epoch; epochs roll over
mid-step so all workers always draw the same number of micro-batches), runs all
but the last under ``no_sync()``, and calls ``backward(loss, num_items=...)`` so
the gradient is the exact mean over every item (token or sample) of the global
batch. Rank 0 reports, writes metrics and checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time

import torch

from .. import dist as gdist
from ..data import DistributedSampler
from ..engine import tracing
from ..engine.clip import clip_grad_norm_
from ..engine.strategy import build_strategy, memory_report
from ..errors import UsageError
from . import state
from .checkpoint import CHECKPOINT, remove_stale_temporaries
from .config import TrainConfig
from .data_setup import build_task, collate
from .instrument import Instruments, baseline_rate_of, drift_line, write_report_safely
from .progress import MetricsWriter, RunDisplay

FAULT_ENV = "GRADSYNC_FAULT"
"""Testing aid: ``RANK:STEP:KIND`` (KIND raise | exit | kill) makes that rank fail mid-step;
KIND perturb nudges that rank's first parameter, so its replica drifts (for the drift check)."""



def _interrupt_on_sigterm() -> None:
    """The launcher stops workers with SIGTERM; unwind like Ctrl-C so cleanup runs."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


def _inject_fault(rank: int, step: int, module=None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    f_rank, f_step, kind = spec.split(":")
    if int(f_rank) != rank or int(f_step) != step:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "exit":
        os._exit(7)
    if kind == "perturb" and module is not None:
        with torch.no_grad():
            next(module.parameters()).view(-1)[0] += 1e-3
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def micro_batches(sampler: DistributedSampler, size: int):
    """Endless stream of index lists of ``size``, rolling over epochs via ``set_epoch``."""
    if len(sampler) == 0:
        raise UsageError(
            f"rank {sampler.rank} has no samples: {sampler.dataset_len} samples "
            f"cannot feed {sampler.num_replicas} workers"
        )
    it, buf = iter(sampler), []
    while True:
        for i in it:
            buf.append(i)
            if len(buf) == size:
                yield buf
                buf = []
        sampler.set_epoch(sampler.epoch + 1)
        it = iter(sampler)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_spec(cfg: TrainConfig):
    """AdamW for the language model, SGD with momentum for the MLP: (class, kwargs)."""
    if cfg.model == "gpt":
        return torch.optim.AdamW, {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    return torch.optim.SGD, {"lr": cfg.lr, "momentum": 0.9}


def run_worker(cfg_dict: dict) -> dict | None:
    """Train on this rank; rank 0 returns the run summary, the others ``None``."""
    cfg = TrainConfig(**cfg_dict)
    info = gdist.info()
    rank, world, device = info.rank, info.world_size, info.device
    accum = cfg.accumulation(world)
    _interrupt_on_sigterm()
    started = time.perf_counter()

    task = build_task(cfg)
    sampler = DistributedSampler(
        task.dataset, num_replicas=world, rank=rank, seed=cfg.seed, mode="exact"
    )
    opt_cls, opt_kwargs = optimizer_spec(cfg)
    dp, opt = build_strategy(task.model.to(device), cfg.strategy, cfg.precision, opt_cls,
                             bucket_mb=cfg.bucket_mb, **opt_kwargs)
    replicated = cfg.strategy != "zero3"  # ZeRO-3 ranks hold different parameter shards
    # sharded gradients live with whoever holds the shards: the global norm is theirs to take
    clip_target = opt if hasattr(opt, "grad_shards") else dp
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    ckpt_path = os.path.join(cfg.out, CHECKPOINT)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        remove_stale_temporaries(cfg.out)
    start_step = state.resume(cfg, ckpt_path, world, rank, dp, opt, sched, sampler, device)
    batches = micro_batches(sampler, cfg.micro_batch)

    unit = "tok" if task.tokens_per_sample else "samples"
    per_step_units = cfg.global_batch * (task.tokens_per_sample or 1)
    units = {"samples": cfg.global_batch}
    if task.tokens_per_sample:
        units["tokens"] = cfg.global_batch * task.tokens_per_sample
    baseline_rate = baseline_rate_of(cfg) if rank == 0 else None
    inst = Instruments(cfg, rank, world, device)
    writer = MetricsWriter(os.path.join(cfg.out, "metrics.jsonl")) if rank == 0 else None
    if rank == 0:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(
                {
                    **cfg.to_dict(),
                    "world_size": world,
                    "accumulation": accum,
                    "backend": info.backend,
                },
                f,
                indent=2,
            )
    display = RunDisplay(cfg.steps, start_step, unit) if rank == 0 else None
    loss = float("nan")
    mem = None
    step_times: list[float] = []
    loop_started = time.perf_counter()
    with display if display else contextlib.nullcontext():
        for step in range(start_step, cfg.steps):
            inst.begin_step(step + 1)
            t0 = time.perf_counter()
            loss_sum, items = 0.0, 0
            for k in range(accum):
                if k == accum - 1:
                    _inject_fault(rank, step, dp.module)
                x, y = collate(task.dataset, next(batches))
                x, y = x.to(device), y.to(device)
                n = x.shape[0] * task.items_per_sample
                with dp.no_sync() if k < accum - 1 else contextlib.nullcontext():
                    micro_loss = task.loss_fn(dp(x), y)
                    dp.backward(micro_loss, num_items=n)
                loss_sum += micro_loss.item() * n
                items += n
            with tracing.span("optimizer"):
                if cfg.clip:
                    clip_grad_norm_(clip_target, cfg.clip)
                opt.step()
                sched.step()
                if step + 1 == cfg.steps:  # the summary's report: the step at its fullest,
                    mem = memory_report(dp, opt)  # gradients and optimizer state both held
                opt.zero_grad(set_to_none=True)
            stats = inst.gather_stats(loss_sum, float(items))
            total_loss, total_items = float(stats[:, 0].sum()), float(stats[:, 1].sum())
            loss = total_loss / total_items
            step_s = time.perf_counter() - t0
            step_times.append(step_s)
            inst.end_step(step + 1)
            if rank == 0:
                base = {"step": step + 1, "loss": loss, "lr": sched.get_last_lr()[0],
                        "items": int(total_items), f"{unit}_per_s": per_step_units / step_s,
                        "time_s": time.perf_counter() - loop_started}
                writer.write(inst.record(step + 1, stats, step_s, base, units, baseline_rate))
                display.update(step + 1, loss, per_step_units / step_s, step_s)
            done = step + 1
            if done in (start_step + 1, cfg.steps) or (inst.window and done == inst.window[1]):
                if hasattr(dp, "bucket_plan"):
                    inst.write_plan(dp)
            if replicated:
                inst.maybe_check_drift(done, dp.module)
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                state.save(cfg, ckpt_path, done, world, dp, opt, sched, sampler, loss)
    inst.close()
    if writer:
        writer.close()
    if rank != 0:
        return None
    steady = sorted(step_times[min(3, len(step_times) - 1) :]) if step_times else [float("nan")]
    median_step = steady[len(steady) // 2]
    tuned = getattr(dp, "autotune_result", None)
    mem = mem or memory_report(dp, opt)
    summary = {
        "final_loss": loss,
        "steps": cfg.steps,
        "resumed_from": start_step,
        "world_size": world,
        "accumulation": accum,
        "median_step_s": median_step,
        f"{unit}_per_s": per_step_units / median_step,
        "train_wall_s": time.perf_counter() - loop_started,
        "total_wall_s": time.perf_counter() - started,
        "checkpoint": ckpt_path,
        "buckets": len(getattr(dp, "bucket_plan", ())),
        "strategy": cfg.strategy,
        "precision": cfg.precision,
        "memory": dataclasses.asdict(mem),
        "samples_per_s": cfg.global_batch / median_step,
        "drift": inst.drift,
        "traced_steps": list(inst.window) if inst.window else None,
        "bucket_cap_mb": getattr(dp, "bucket_cap_bytes", 0) / 2**20,
        "autotune": None if tuned is None else {
            "candidates_mb": tuned.candidates_mb,
            "median_s": tuned.median_s,
            "chosen_mb": tuned.chosen_mb,
        },
    }
    if baseline_rate:
        summary["baseline_samples_per_s"] = baseline_rate
        summary["scaling_efficiency"] = summary["samples_per_s"] / (world * baseline_rate)
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    display.summary(
        [
            ("final loss", f"{loss:.4f}"),
            (f"throughput ({unit}/s, median step)", f"{summary[f'{unit}_per_s']:,.0f}"),
            ("median step time", f"{median_step * 1e3:.1f} ms"),
            ("workers x accumulation", f"{world} x {accum}"),
            ("scaling efficiency vs 1 worker",
             f"{summary['scaling_efficiency']:.0%}" if baseline_rate
             else "n/a (1 worker)" if world == 1 else "(run with --baseline)"),
            ("drift check", drift_line(inst.drift)),
            ("gradient buckets", "per wrapped unit (zero3)" if cfg.strategy == "zero3" else
             f"{summary['buckets']} (cap {summary['bucket_cap_mb']:.2f} MiB"
             + (", auto-tuned)" if tuned and tuned.chosen_mb else ")")),
            ("wall time", f"{summary['total_wall_s']:.1f} s"),
            ("checkpoint", ckpt_path),
        ],
        title=f"gradsync train: {cfg.model} on {cfg.data} ({cfg.strategy}, {cfg.precision})",
    )
    display.console.print(mem.render(), highlight=False)
    if not cfg.no_report:
        write_report_safely(cfg.out)
    return summary

