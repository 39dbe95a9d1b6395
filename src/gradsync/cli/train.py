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

from ..errors import WorkerFailedError
from ..sigint import held

EPILOG = """examples:
  gradsync train                                   # 2 workers, small GPT on Python stdlib sources
  gradsync train --workers 4 --global-batch 64 --micro-batch 8 --steps 500
  gradsync train --out runs/a                      # again: continues runs/a where it stopped
  gradsync train --out runs/a --workers 3          # ... on 3 workers, exactly the same steps
  gradsync train --model my_pkg.nets:build --data my_pkg.data:build
  gradsync train --keep-best eval_loss --early-stop eval_loss:5 --eval-every 25
  gradsync train --init-from out/a --activation-checkpointing --loader-workers 4
  gradsync train --print-config > run.toml; gradsync train --config run.toml --lr 1e-3
  gradsync eval runs/a/checkpoints/best             # its held-out loss, exactly
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


def continue_command(out: str, argv: list[str], workers: int | None = None) -> str:
    """The command line that continues the run in ``out`` (the same one, ``argv`` as given;
    resume is automatic), with ``--workers`` set to ``workers`` when given."""
    new = ["--workers", str(workers)] if workers else []
    if argv[:1] != ["train"]:
        return shlex.join(["gradsync", "train", "--out", out, *new])
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
        keep += ["--out", out]
    return "gradsync " + shlex.join(keep + new)


def _run_baseline(cfg, accumulation: int) -> None:
    from ..launch import launch
    from ..train.config.train_config import baseline_config
    from ..train.worker.loop import run_worker

    bcfg = baseline_config(cfg, accumulation)
    out = bcfg.run.out
    if os.path.islink(out):  # a link in the baseline's place: removed, never followed
        os.remove(out)
    if os.path.exists(os.path.join(out, "summary.json")):
        print(f"gradsync train: reusing the baseline in {out}", flush=True)
        return
    if os.path.exists(out):
        import shutil

        shutil.rmtree(out)  # an unfinished baseline: start it again
    os.makedirs(out)
    steps = bcfg.run.steps
    print(f"gradsync train: 1-worker baseline, {steps} step{'' if steps == 1 else 's'}, "
          f"micro-batch {bcfg.batch.micro_batch} x accumulation {accumulation}", flush=True)
    launch(run_worker, 1, (bcfg, None, None, None, True),
           backend=cfg.run.backend, timeout_s=cfg.run.timeout)


def _report_failure(err: WorkerFailedError, where: str) -> None:
    import re

    # the line naming the root cause (a hang report may come before it)
    first = next((ln for ln in str(err).splitlines() if ln.startswith("worker rank ")), "")
    m = re.match(r"worker rank (\d+) failed: (\w+): (.*)", first)
    if m and m.group(2) in _PLAIN:
        print(f"gradsync train: error: {m.group(3)} (worker rank {m.group(1)})", file=sys.stderr)
    else:
        print(f"gradsync train: error: {err}", file=sys.stderr)
    print(f"gradsync train: {where}", file=sys.stderr)


def run(args) -> int:
    with held():  # imports (gradsync.sigint): a Ctrl-C meanwhile is raised after them
        from ..train.config.flags import from_args

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    given = from_args(args, argv[1:] if argv[:1] == ["train"] else argv)  # --config's too
    cfg = given.resolved()  # every flag checked, once
    if args.print_config:  # the resolved flags as a --config file; nothing starts
        print(given.to_toml(), end="")
        return 0
    if cfg.ft.launcher:  # one machine: a lighthouse and N groups
        from .train_groups import run_groups

        return run_groups(cfg, argv)
    return train_job(cfg, argv)


def train_job(cfg, argv: list[str], out: str | None = None) -> int:
    """One job of workers on this machine: preflight, launch, the outcome in one line.

    ``argv``: the command as given, which the hints repeat; ``out``: the run directory
    that command names (a replica group's job runs in a directory of its own, below it).
    """
    with held():
        from torch.distributed.elastic.multiprocessing import SignalException

        from ..rundir import METRICS
        from ..train.checkpoint.restarts import where_to_continue
        from ..train.launcher.api import launch_workers, usage_error_of
        from ..train.launcher.preflight import preflight
        from ..train.records.instrument import write_report_safely
        from ..train.records.summary import repair_summary
        from ..train.task.schedule import finished_line
        from ..train.worker.faults import FaultInjector

    out = out or cfg.run.out

    def where(failed: bool = False) -> str:
        return where_to_continue(cfg.run.out, cfg.run.trust_checkpoint_code,
                                 continue_command(out, argv), failed)

    faults = FaultInjector.from_env()  # the edge: the loop only ever sees the object
    plan, lock = preflight(cfg, continue_with=lambda n: continue_command(out, argv, n))
    try:
        if lock.note():
            print(f"gradsync train: {lock.note()}")
        if plan.action == "finished":
            print(finished_line(cfg, plan.step, plan.schedule_steps, plan.notes))
            repair_summary(cfg.run.out)
            return 0
        was, workers, steps = plan.was_world, cfg.run.workers, cfg.run.steps
        how = (f"continuing from step {plan.step}, checkpointed by {was} "
               f"worker{'' if was == 1 else 's'}"
               if plan.action == "resume" else "new run")
        print(f"gradsync train: {workers} worker{'' if workers == 1 else 's'}, "
              f"{cfg.run.model} on {cfg.run.data}, {steps} step{'' if steps == 1 else 's'}, "
              f"run directory {cfg.run.out} ({how})", flush=True)
        try:
            if cfg.observe.baseline:
                _run_baseline(cfg, plan.accumulation)
            launch_workers(cfg, faults=faults)
        except WorkerFailedError as e:
            usage = usage_error_of(e)
            if usage is not None:
                raise usage from None
            _report_failure(e, where(failed=True))
            if not cfg.observe.no_report and os.path.exists(os.path.join(cfg.run.out, METRICS)):
                write_report_safely(cfg.run.out)  # a failed run is when the report is most needed
            return 1
        except (SignalException, KeyboardInterrupt):
            print(f"\ngradsync train: interrupted; {where()}", file=sys.stderr)
            return 130
        return 0
    finally:
        lock.release()
