"""`gradsync calibrate`: measure alpha/beta and the model's backward; write the profile.

The profile it writes is what ``gradsync simulate --profile FILE`` reads, so the
bucket sweep and the timeline are for this model on this machine rather than a
uniform model with guessed link numbers.
"""

from __future__ import annotations

import argparse
import re
import sys

from ..errors import UsageError, WorkerFailedError

EPILOG = """\
examples:
  gradsync calibrate --model gpt --workers 2 --out profile.json --png fit.png
  gradsync calibrate --model mlp --quick
  gradsync calibrate --model mypkg.models:build --micro-batch 16
  gradsync simulate --profile profile.json --sweep-png sweep.png
A module:factory model gets its batch from an example_batch(micro_batch, seq_len)
method, else from its first Linear/Embedding layer; its loss is mean(logits^2)
(a transformers ModelOutput is read through .logits).
Hosts of several ranks have two links (inside a host, between hosts): measure them
separately with `gradsync netlab calibrate` (emulated hosts) or
`torchrun ... -m gradsync.calibrate.links` (real ones); see docs/netlab.md."""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "calibrate", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="gpt",
                   help="gpt, mlp or module:factory (a function returning an nn.Module)")
    p.add_argument("--workers", "-n", type=int, default=2,
                   help="processes to time collectives on (>= 2)")
    p.add_argument("--micro-batch", type=int,
                   help="samples per worker micro-batch (default: gpt 8, mlp 64, others 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sample for gpt/Embedding models "
                   "(default 128)")
    p.add_argument("--quick", action="store_true",
                   help="fewer, smaller messages (4 KB..16 MB) and fewer repetitions")
    p.add_argument("--out", default="profile.json", metavar="FILE",
                   help="profile JSON for gradsync simulate --profile (default profile.json)")
    p.add_argument("--png", metavar="FILE", help="measured points and fitted lines")
    p.add_argument("--free-overlap", action="store_true",
                   help="write overlap penalties of 0 (overlapped communication costs backward "
                   "nothing); by default the measured penalties f and g go into the profile")
    p.add_argument("--json", action="store_true", help="print the fits as JSON instead of tables")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from ..calibrate.workload import check_spec

    if args.workers is None or args.workers < 2:
        raise UsageError(f"--workers must be >= 2 (collectives need a peer), got {args.workers}")
    for flag, v in (("--micro-batch", args.micro_batch), ("--seq-len", args.seq_len)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    check_spec(args.model)  # before any process starts
    from ..calibrate import calibrate
    from ..plan.profile import profile_to_json

    try:
        cal = calibrate(args.model, args.workers, args.micro_batch, args.seq_len,
                        quick=args.quick, overlap_penalties=not args.free_overlap)
    except WorkerFailedError as e:  # as `gradsync train`: a worker's bad input is exit 2
        first = str(e).splitlines()[0]
        m = re.match(r"worker rank \d+ failed: UsageError: (.*)", first)
        if m:
            raise UsageError(m.group(1)) from None
        print(f"gradsync calibrate: error: {e}", file=sys.stderr)
        return 1
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(profile_to_json(cal.profile))
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror}") from None
    if args.json:
        import dataclasses
        import json

        print(json.dumps({op: dataclasses.asdict(t) for op, t in cal.collectives.ops.items()},
                         indent=1))
    else:
        from ..observe.calibrate_view import backward_table, fit_table
        from ..observe.plan_tables import print_table

        print_table(fit_table(cal.collectives))
        print_table(backward_table(cal))
        print(f"wrote {args.out}; next: gradsync simulate --profile {args.out}")
    if args.png:
        from ..observe.calibrate_view import fit_png

        fit_png(cal.collectives, args.png)
    return 0
