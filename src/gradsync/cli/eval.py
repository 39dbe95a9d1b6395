"""`gradsync eval RUN [--data SPEC]`: a checkpoint scored on the held-out set, exactly."""

from __future__ import annotations

import argparse
import json


def register(sub, help_line: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval", help=help_line,
        description=help_line[0].upper() + help_line[1:] + ": the exact mean loss over the "
        "whole held-out set, and your TrainData.metrics, by the training loop's own "
        "evaluation. On the run's number of workers (the default) it is the run's eval_loss "
        "at that step, bit for bit (said when the run recorded one); on another, the same "
        "mean summed in another order. The run directory is only read. See docs/train.md.",
    )
    p.add_argument("run_dir", metavar="RUN",
                   help="a run directory (its newest checkpoint), a kept checkpoint "
                        "(RUN/checkpoints/step-N) or RUN/checkpoints/best / last")
    p.add_argument("--model", default=None, metavar="SPEC",
                   help="the model factory, pkg.module:factory or path/to/file.py:factory: "
                        "needed when the run was trained with one (a factory a run directory "
                        "records is never imported on its word)")
    p.add_argument("--data", default=None, metavar="SPEC",
                   help="the data factory (needed as --model is), or other data whose held-out "
                        "set to score instead (a built-in name or pkg.module:factory)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: as many as wrote the checkpoint, which "
                        "gives the run's own bits)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--trust-checkpoint-code", action="store_true",
                   help="load the checkpoint with full pickle, which can run code the file "
                        "names: only for a checkpoint you wrote yourself holding your own types")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the evaluation fails (default: 300)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: pick a free one)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="process-group backend (default: auto)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from ..errors import UsageError
    from ..train.launcher.evaluate import as_json, describe, evaluate

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be an integer >= 1, got {args.workers}")
    r = evaluate(args.run_dir, model=args.model, data=args.data, workers=args.workers,
                 trust_checkpoint_code=args.trust_checkpoint_code, timeout=args.timeout,
                 port=args.port, backend=args.backend)
    if args.json:
        print(json.dumps(as_json(r), indent=1))
    else:
        print("\n".join(describe(r)))
    return 0
