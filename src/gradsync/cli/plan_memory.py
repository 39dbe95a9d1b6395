"""`gradsync plan memory MODEL`: will it fit, and with which ZeRO stage."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..plan.memory import (
    CHECKPOINTING,
    OPTIMIZERS,
    ActivationShape,
    plan_memory,
    resolve_param_count,
)
from ..plan.units import parse_bytes
from ._common import positive, print_json

EPILOG = """\
MODEL is a parameter count (7e9, 7B, 125M), a built-in model (gpt, mlp) or
module:factory (a function returning an nn.Module, built on the meta device so
nothing is allocated). Sizes use GB = 1e9 bytes; GiB = 2^30 is accepted too.
Formulas (ZeRO, arXiv 1910.02054): DP 16P, ZeRO-1 4P+12P/N, ZeRO-2 2P+14P/N,
ZeRO-3 16P/N for mixed-precision Adam. Activations: Korthikanti et al. 2022
(arXiv 2205.05198), 34sbh + 5as^2b bytes per layer; 2sbh with full checkpointing.
example: gradsync plan memory 7.5B --workers 64 --device-memory 80GB"""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "memory", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="count, built-in name or module:factory")
    p.add_argument("--workers", "-n", type=int, default=8, help="data-parallel ranks N")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--fp32", action="store_true", help="train in fp32 (no 16-bit copies)")
    p.add_argument("--fp32-grad-accum", action="store_true",
                   help="keep an extra fp32 gradient (20P with Adam; DeepSpeed's 2P+18P/N)")
    p.add_argument("--device-memory", metavar="SIZE", help="e.g. 80GB, 24GiB: fits verdict")
    g = p.add_argument_group("activations (transformer shape; give all of them)")
    g.add_argument("--micro-batch", type=int, default=1)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--checkpointing", choices=CHECKPOINTING, default="none")
    p.add_argument("--png", metavar="FILE", help="write a stacked bar chart")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run, command="plan memory")
    return p


def run(args) -> int:
    positive(args.workers, "--workers")
    if args.fp32 and args.fp32_grad_accum:
        raise UsageError("--fp32-grad-accum applies to mixed precision; drop --fp32")
    count, source = resolve_param_count(args.model)
    shape_flags = (args.seq_len, args.hidden, args.layers, args.heads)
    activation = None
    if any(v is not None for v in shape_flags):
        if any(v is None for v in shape_flags):
            raise UsageError("activation estimate needs --seq-len, --hidden, --layers and --heads")
        activation = ActivationShape(args.micro_batch, args.seq_len, args.hidden, args.layers,
                                     args.heads, args.checkpointing)
    device = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
    plan = plan_memory(count, args.workers, args.optimizer, not args.fp32, args.fp32_grad_accum,
                       activation, device)
    if args.json:
        print_json(plan)
    else:
        from ..observe.plan_tables import memory_table, print_table

        print_table(memory_table(plan, source))
    if args.png:
        from ..observe.plan_plots import memory_png

        memory_png(plan, args.png)
    return 0
