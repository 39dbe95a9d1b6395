"""`gradsync plan batch`: the batch recipe gbs = mbs x grad_acc x dp (arXiv 2104.04473)."""

from __future__ import annotations

import argparse

from ..plan.batch import plan_batch
from ..plan.units import parse_count, parse_int_list
from ._common import positive, print_json

EPILOG = """\
example (4M-token batch, 4096-token samples): gradsync plan batch --tokens 4M --seq-len 4096
  --micro-batch 2 --workers 128,512,1024   -> 976 -> 1024 samples; 4, 1, below 1"""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "batch", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", required=True, help="global batch in tokens (4M, 4e6)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    p.add_argument("--micro-batch", type=int, required=True, help="samples per forward pass")
    p.add_argument("--workers", required=True, help="comma-separated worker counts, 8,64,512")
    p.add_argument("--no-round", action="store_true",
                   help="do not round samples per step to the nearest power of two")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run, command="plan batch")
    return p


def run(args) -> int:
    positive(args.seq_len, "--seq-len")
    positive(args.micro_batch, "--micro-batch")
    plan = plan_batch(parse_count(args.tokens, "--tokens"), args.seq_len, args.micro_batch,
                      parse_int_list(args.workers, "--workers"), round_pow2=not args.no_round)
    if args.json:
        print_json(plan)
    else:
        from ..observe.plan_tables import batch_table, print_table

        print_table(batch_table(plan))
    return 0
