"""`gradsync train`: launch K workers with torch's elastic launcher and train a model.

Everything checkable is checked here, before any worker starts (flags, data size,
the run directory, the lock, the checkpoint's configuration and checksums), and
said in one line with exit code 2. A failure after launch says what failed first
and ends with the command that continues the run (resuming is automatic).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ..errors import UsageError, WorkerFailedError
from ..sigint import held

EPILOG = """examples:
  gradsync train                                   # 2 workers, small GPT on Python stdlib sources
  gradsync train --workers 4 --global-batch 64 --micro-batch 8 --steps 500
  gradsync train --out runs/a                      # again: continues runs/a where it stopped
  gradsync train --out runs/a --workers 3          # ... on 3 workers, exactly the same steps
  gradsync train --model my_pkg.nets:build --data my_pkg.data:build
elastic (restarts every worker from the last checkpoint after a failure):
  torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m gradsync.train --out runs/a
multi-node (same flags, launched by torchrun on every node):
  torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
           --rdzv-endpoint HOST0:29500 -m gradsync.train --steps 300 --out /shared/runs/a
"""

# errors whose message says it all: printed first, without their traceback
_PLAIN = ("NonFiniteError", "StorageError", "InjectedFault", "UnusedParametersError",
          "ReplicaMismatchError", "QuorumTimeout")


def register(sub, help_line: str) -> argparse.ArgumentParser:
    from ..train.config.flags import add_arguments

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


_command_line: list[str] = []
"""The command as given (``gradsync.cli.main`` sets ``args.argv``; :func:`run` keeps it)."""


def continue_command(cfg, workers: int | None = None) -> str:
    """The command line that continues this run (the same one; resume is automatic),
    with ``--workers`` set to ``workers`` when given."""
    argv = _command_line
    new = ["--workers", str(workers)] if workers else []
    if argv[:1] != ["train"]:
        return shlex.join(["gradsync", "train", "--out", cfg.out, *new])
    keep, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("--resume=never", "--resume=auto") or (new and a.startswith("--workers=")):
            continue
        if ((a == "--resume" and i + 1 < len(argv) and argv[i + 1] in ("never", "auto"))
                or (new and a == "--workers")):
            skip = True
            continue
        keep.append(a)
    if "--out" not in keep and not any(a.startswith("--out=") for a in keep):
        keep += ["--out", cfg.out]
    return "gradsync " + shlex.join(keep + new)


def _check_local_sync_world(cfg, plan) -> None:
    """A DiLoCo run continues on the number of workers that wrote it: say so before launch,
    with the command that continues it."""
    was = plan.was_world
    if plan.action != "resume" or cfg.sync == "exact" or not was or was == cfg.workers:
        return
    raise UsageError(f"{cfg.out} holds a --sync {cfg.sync} run of {was} "
                     f"worker{'' if was == 1 else 's'}, which continues "
                     f"on {was} only (between syncs every worker holds its own replica and inner "
                     f"optimizer state); continue it with: {continue_command(cfg, was)}")


def _where(cfg, failed: bool = False) -> str:
    """Where the run stands: the last complete checkpoint, if any (after a failure, the
    command continues once its cause is fixed: rerunning a model error repeats it)."""
    from ..rundir import CHECKPOINT
    from ..safeload import trusting
    from ..train.checkpoint.unit import read_unit

    ckpt = os.path.join(cfg.out, CHECKPOINT)
    try:
        with trusting(cfg.trust_checkpoint_code):  # data only, unless the user opted in
            header = read_unit(ckpt)  # verified: a damaged one is not offered as a step
    except UsageError as e:
        return f"no usable checkpoint to continue from: {e}"
    fixed = "once the cause is fixed, " if failed else ""
    if header is None:
        return f"no checkpoint had been written yet; {fixed}the same command starts again"
    return (f"the last complete checkpoint ({ckpt}, step {header['step']}) is intact; "
            f"{fixed}continue from step {header['step']} with: {continue_command(cfg)}")


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
                   eval_every=0, resume="auto", port=0, max_restarts=0, log="",
                   baseline_steps=type(cfg).baseline_steps,  # its default: no --baseline here
                   data_parts=1)  # one worker reads the whole set; the work per step is alike


def _run_baseline(cfg, model_fn=None, data_fn=None) -> None:
    from ..launch import launch
    from ..train.worker.loop import run_worker

    bcfg = baseline_config(cfg)
    if os.path.islink(bcfg.out):  # a link in the baseline's place: removed, never followed
        os.remove(bcfg.out)
    if os.path.exists(os.path.join(bcfg.out, "summary.json")):
        print(f"gradsync train: reusing the baseline in {bcfg.out}", flush=True)
        return
    if os.path.exists(bcfg.out):
        import shutil

        shutil.rmtree(bcfg.out)  # an unfinished baseline: start it again
    os.makedirs(bcfg.out)
    print(f"gradsync train: 1-worker baseline, {bcfg.steps} step{'' if bcfg.steps == 1 else 's'}"
          f", micro-batch "
          f"{bcfg.micro_batch} x accumulation {bcfg.global_batch // bcfg.micro_batch}",
          flush=True)
    launch(run_worker, 1, (bcfg.to_dict(), model_fn, data_fn, None, True),
           backend=cfg.backend, timeout_s=cfg.timeout)


def _report_failure(cfg, err: WorkerFailedError) -> None:
    import re

    # the line naming the root cause (a hang report may come before it)
    first = next((ln for ln in str(err).splitlines() if ln.startswith("worker rank ")), "")
    m = re.match(r"worker rank (\d+) failed: (\w+): (.*)", first)
    if m and m.group(2) in _PLAIN:
        print(f"gradsync train: error: {m.group(3)} (worker rank {m.group(1)})", file=sys.stderr)
    else:
        print(f"gradsync train: error: {err}", file=sys.stderr)
    print(f"gradsync train: {_where(cfg, failed=True)}", file=sys.stderr)


def run(args) -> int:
    with held():  # imports (gradsync.sigint): a Ctrl-C meanwhile is raised after them
        from torch.distributed.elastic.multiprocessing import SignalException

        from ..rundir import METRICS
        from ..train.config.flags import from_args
        from ..train.launcher.api import launch_workers, usage_error_of
        from ..train.launcher.preflight import preflight
        from ..train.records.instrument import write_report_safely
        from ..train.records.summary import repair_summary
        from ..train.task.schedule import finished_line
        from ..train.worker.faults import FaultInjector

    global _command_line
    argv = _command_line = list(getattr(args, "argv", None) or sys.argv[1:])
    cfg = from_args(args)
    if cfg.ft_groups and cfg.ft_group < 0:  # one machine: a lighthouse and N groups
        from .train_groups import run_groups

        return run_groups(cfg, argv[1:] if argv[:1] == ["train"] else argv)
    faults = FaultInjector.from_env()  # the edge: the loop only ever sees the object
    plan, lock = preflight(cfg)
    try:
        _check_local_sync_world(cfg, plan)
        if lock.note():
            print(f"gradsync train: {lock.note()}")
        if plan.action == "finished":
            print(finished_line(cfg, plan.step, plan.schedule_steps))
            repair_summary(cfg.out)
            return 0
        was = plan.was_world
        how = (f"continuing from step {plan.step}, checkpointed by {was} "
               f"worker{'' if was == 1 else 's'}"
               if plan.action == "resume" else "new run")
        print(f"gradsync train: {cfg.workers} worker{'' if cfg.workers == 1 else 's'}, "
              f"{cfg.model} on {cfg.data}, {cfg.steps} step{'' if cfg.steps == 1 else 's'}, "
              f"run directory {cfg.out} ({how})", flush=True)
        try:
            if cfg.baseline:
                _run_baseline(cfg)
            launch_workers(cfg, faults=faults)
        except WorkerFailedError as e:
            usage = usage_error_of(e)
            if usage is not None:
                raise usage from None
            _report_failure(cfg, e)
            if not cfg.no_report and os.path.exists(os.path.join(cfg.out, METRICS)):
                write_report_safely(cfg.out)  # a failed run is when the report is most needed
            return 1
        except (SignalException, KeyboardInterrupt):
            print(f"\ngradsync train: interrupted; {_where(cfg)}", file=sys.stderr)
            return 130
        return 0
    finally:
        lock.release()
