"""`torchrun ... -m gradsync.train [flags]`: the training entry point when torchrun launches.

torchrun has already started the processes and set RANK/WORLD_SIZE/MASTER_ADDR,
so this parses the same flags as `gradsync train` (minus --workers and --port,
which are torchrun's business) and runs the worker loop directly.
"""

import argparse
import sys

from .. import dist as gdist
from ..errors import UsageError
from ..heap import keep_freed_memory
from .config import add_arguments, from_args
from .loop import run_worker


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradsync.train",
                                     description="gradsync training worker (run under torchrun)")
    add_arguments(parser, skip=("workers", "port"))
    args = parser.parse_args(argv)
    try:
        cfg = from_args(args)
        if cfg.baseline:
            raise UsageError("--baseline launches its own 1-worker run: use `gradsync train "
                             "--baseline`, or run the baseline with torchrun separately")
        import torch

        torch.set_num_threads(int(__import__("os").environ.get("GRADSYNC_THREADS", "1")))
        keep_freed_memory()
        gdist.init(cfg.backend, cfg.timeout)
        cfg.workers = gdist.world_size()
        run_worker(cfg.to_dict())
    except UsageError as e:
        print(f"gradsync.train (rank {gdist.rank()}): error: {e}", file=sys.stderr)
        return 2
    finally:
        gdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
