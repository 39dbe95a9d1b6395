"""`torchrun ... -m gradsync.train [flags]`: the training entry point when torchrun launches.

torchrun has already started the processes and set RANK/WORLD_SIZE/MASTER_ADDR,
so this parses the same flags as `gradsync train` (minus --workers, --port and
--max-restarts, which are torchrun's business) and runs the worker loop directly.

Elastic by default: with ``--resume auto`` (the default) a restarted worker
group -- ``torchrun --max-restarts N`` after a failure, or ``--nnodes MIN:MAX``
after the membership changed -- continues from the last checkpoint, on however
many workers it now has, with no flag changed. Global rank 0 holds the run
directory's lock (the agent is torchrun's, not ours); a restarted rank 0 finds
the lock its killed predecessor held released by the kernel.
"""

import argparse
import os
import sys
import traceback

from .. import dist as gdist
from ..errors import GradsyncError, UsageError
from ..heap import keep_freed_memory
from .checkpoint.restarts import where_to_continue
from .config.flags import add_arguments, from_args
from .worker.faults import FaultInjector
from .worker.loop import run_worker

TORCHRUN_AGAIN = "the same torchrun command (resuming is automatic)"


def _restarts_left() -> int:
    """How many more times torchrun's agent will restart this worker group."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - gdist.restart_count()
    except ValueError:
        return 0


def _lost_a_peer(e: BaseException) -> str | None:
    """One line for a rank that failed only because another one died (gloo's connection
    errors and their 30-line tracebacks say nothing about the cause), else None."""
    from ..failures import SECONDARY

    m = SECONDARY.search(f"{type(e).__name__}: {e}")
    if m is None:
        return None
    then = ("torchrun restarts the workers from the last checkpoint" if _restarts_left() > 0
            else "torchrun's log names the worker that failed first")
    return f"stopped: another worker failed ({m.group(0)}); {then}"


def main(argv=None, callbacks=None) -> int:
    """Parse the flags and train this rank. ``callbacks``: ``gs.Callback`` objects for
    rank 0 (``records/callbacks.py``), for a script that wraps this entry point under torchrun
    (the slow-link benchmark counts the bytes on its link after every step)."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.train",
                                     description="gradsync training worker (run under torchrun)")
    add_arguments(parser, skip=("workers", "port", "max_restarts"))
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    cfg = None
    try:
        # every flag checked once, for the world torchrun set up (its WORLD_SIZE)
        given = from_args(args, sys.argv[1:] if argv is None else argv,
                          workers=int(os.environ.get("WORLD_SIZE", "1")))
        cfg = given.resolved()
        if args.print_config:  # rank 0 says it; nothing starts
            if rank in ("0", "?"):
                print(given.to_toml(), end="")
            return 0
        if cfg.observe.baseline:
            raise UsageError("--baseline launches its own 1-worker run: use `gradsync train "
                             "--baseline`, or run the baseline with torchrun separately")
        faults = FaultInjector.from_env()  # the edge: the loop only ever sees the object
        import torch

        torch.set_num_threads(int(os.environ.get("GRADSYNC_THREADS", "1")))
        keep_freed_memory()
        gdist.init(cfg.run.backend, cfg.run.timeout)
        run_worker(cfg, faults=faults, callbacks=callbacks)
    except UsageError as e:
        print(f"gradsync.train (rank {rank}): error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # the agent stops the group with SIGTERM
        print(f"gradsync.train (rank {rank}): stopped ({e or 'interrupted'})", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - said once, with the way to continue
        echo = None if isinstance(e, GradsyncError) else _lost_a_peer(e)
        if isinstance(e, GradsyncError):  # its message says it all: no traceback
            print(f"gradsync.train (rank {rank}): error: {type(e).__name__}: {e}",
                  file=sys.stderr)
        elif echo:
            print(f"gradsync.train (rank {rank}): {echo}", file=sys.stderr)
        else:
            traceback.print_exc()
        if rank == "0" and cfg is not None and not (echo and _restarts_left() > 0):
            hint = where_to_continue(cfg.run.out, cfg.run.trust_checkpoint_code, TORCHRUN_AGAIN,
                                     failed=True)
            print(f"gradsync.train: {hint}", file=sys.stderr)
        return 1
    finally:
        gdist.shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # a second SIGTERM while shutting down: already said
        code = 130
    sys.exit(code)
