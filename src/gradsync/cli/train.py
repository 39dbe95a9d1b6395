"""`gradsync train`: launch K workers with torch's elastic launcher and train a built-in model."""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys

from ..errors import UsageError, WorkerFailedError

EPILOG = """examples:
  gradsync train                                   # 2 workers, small GPT on Python stdlib sources
  gradsync train --workers 4 --global-batch 64 --micro-batch 8 --steps 500
  gradsync train --out runs/a --resume             # continue an interrupted run
multi-node (same flags, launched by torchrun on every node):
  torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
           --rdzv-endpoint HOST0:29500 -m gradsync.train --steps 300
"""


def register(sub, help_line: str) -> argparse.ArgumentParser:
    from ..train.config import add_arguments

    p = sub.add_parser(
        "train",
        help=help_line,
        description=help_line[0].upper() + help_line[1:] + ".",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UsageError(
                f"port {port} on localhost is already in use; choose another "
                "--port or leave it out to pick a free one"
            ) from None


def preflight(cfg) -> None:
    """Everything that can be checked before starting processes, checked once, clearly."""
    from .. import dist as gdist
    from ..train.checkpoint import CHECKPOINT
    from ..train.data_setup import dataset_for

    cfg.accumulation(cfg.workers)
    gdist.resolve_backend(cfg.backend)
    try:
        n = len(dataset_for(cfg))
    except ValueError as e:  # e.g. a sequence longer than the whole corpus
        raise UsageError(f"--data {cfg.data}: {e}") from None
    if n < cfg.workers:
        raise UsageError(
            f"{cfg.workers} workers but only {n} samples in --data {cfg.data}: "
            "every worker needs at least one"
        )
    ckpt = os.path.join(cfg.out, CHECKPOINT)
    if cfg.resume and not os.path.exists(ckpt):
        raise UsageError(f"--resume: no checkpoint at {ckpt}")
    if not cfg.resume and os.path.exists(ckpt):
        raise UsageError(
            f"{cfg.out} already holds a checkpoint; pass --resume to continue it "
            "or choose another --out"
        )
    if cfg.port:
        _check_port_free(cfg.port)


def baseline_config(cfg):
    """One worker, the same micro-batch and accumulation: the per-worker work of the real run.

    Scaling efficiency is throughput with K workers over K times this; only the
    global batch shrinks (micro-batch x accumulation), so per-worker compute per
    step is identical and the difference is communication and waiting.
    """
    from dataclasses import replace

    accum = cfg.accumulation(cfg.workers)
    return replace(cfg, workers=1, global_batch=cfg.micro_batch * accum,
                   steps=cfg.baseline_steps, warmup=min(cfg.warmup, cfg.baseline_steps),
                   out=os.path.join(cfg.out, "baseline"), trace=False, trace_steps="",
                   drift_every=0, baseline=False, no_report=True, checkpoint_every=0,
                   resume=False, port=0)


def _run_baseline(cfg) -> None:
    from ..launch import launch
    from ..train.loop import run_worker

    bcfg = baseline_config(cfg)
    if os.path.exists(os.path.join(bcfg.out, "summary.json")):
        print(f"gradsync train: reusing the baseline in {bcfg.out}", flush=True)
        return
    if os.path.exists(bcfg.out):
        import shutil

        shutil.rmtree(bcfg.out)  # an unfinished baseline: start it again
    print(f"gradsync train: 1-worker baseline, {bcfg.steps} steps, micro-batch "
          f"{bcfg.micro_batch} x accumulation {bcfg.global_batch // bcfg.micro_batch}",
          flush=True)
    launch(run_worker, 1, (bcfg.to_dict(),), backend=cfg.backend, timeout_s=cfg.timeout)


def run(args) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException

    from ..launch import launch
    from ..train.checkpoint import CHECKPOINT, load_checkpoint
    from ..train.config import from_args
    from ..train.loop import run_worker

    cfg = from_args(args)
    preflight(cfg)
    print(
        f"gradsync train: {cfg.workers} workers, {cfg.model} on {cfg.data}, "
        f"{cfg.steps} steps, run directory {cfg.out}",
        flush=True,
    )
    try:
        if cfg.baseline:
            _run_baseline(cfg)
        launch(
            run_worker,
            cfg.workers,
            (cfg.to_dict(),),
            backend=cfg.backend,
            timeout_s=cfg.timeout,
            rdzv_endpoint=f"localhost:{cfg.port}",
        )
    except WorkerFailedError as e:
        first = str(e).splitlines()[0]
        m = re.match(r"worker rank \d+ failed: UsageError: (.*)", first)
        if m:
            raise UsageError(m.group(1)) from None
        print(f"gradsync train: error: {e}", file=sys.stderr)
        if not cfg.no_report and os.path.exists(os.path.join(cfg.out, "metrics.jsonl")):
            from ..train.instrument import write_report_safely

            write_report_safely(cfg.out)  # a failed run is when the report is most needed
        return 1
    except (SignalException, KeyboardInterrupt):
        ckpt = os.path.join(cfg.out, CHECKPOINT)
        if os.path.exists(ckpt):
            step = load_checkpoint(ckpt)["step"]
            where = (f"the last complete checkpoint ({ckpt}, step {step}) is intact; "
                     "continue with --resume")
        else:
            where = "no checkpoint had been written yet"
        print(f"\ngradsync train: interrupted; {where}", file=sys.stderr)
        return 130
    return 0
