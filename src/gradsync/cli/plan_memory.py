"""`gradsync plan memory MODEL`: will it fit, and with which ZeRO stage.

Its defaults are `gradsync train`'s (``--precision fp32``, ``--optimizer auto``: the
optimizer train builds for that model), so a plan with no flags describes the run
``gradsync train`` with no flags would start; ``--precision bf16`` is the ZeRO
paper's mixed-precision accounting.
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..plan.memory import (
    ACTIVATION_ITEMSIZE,
    CHECKPOINTING,
    OPTIMIZERS,
    PRECISIONS,
    ActivationShape,
    loader_memory,
    plan_memory,
    resolve_param_count,
    train_optimizer,
)
from ..plan.units import parse_bytes
from ._common import positive, print_json

EPILOG = """\
MODEL is a parameter count (7e9, 7B, 125M), a built-in model (gpt, mlp) or
module:factory (a function returning an nn.Module, built on the meta device so
nothing is allocated). Sizes use GB = 1e9 bytes; GiB = 2^30 is accepted too.
Defaults follow `gradsync train`: --precision fp32 (4-byte parameters and gradients,
no master copy) and the optimizer train's --optimizer auto builds (AdamW; SGD with
momentum for mlp). Formulas (ZeRO, arXiv 1910.02054) with --precision bf16: DP 16P,
ZeRO-1 4P+12P/N, ZeRO-2 2P+14P/N, ZeRO-3 16P/N for mixed-precision Adam; fp32 Adam:
DP 16P, ZeRO-1 8P+8P/N, ZeRO-2 4P+12P/N, ZeRO-3 16P/N. Activations: Korthikanti et
al. 2022 (arXiv 2205.05198), 34sbh + 5as^2b bytes per layer at 2 bytes a value
(66sbh + 9as^2b in fp32); without the shape flags they are not estimated.
--activation-checkpointing (train's flag) counts each block's input and the one block
recomputed in backward; --loader-workers N the host memory of the micro-batches the
data loader holds ahead (N x 2 + 1, and as much again pinned on a GPU).
example: gradsync plan memory 7.5B --precision bf16 --workers 64 --device-memory 80GB"""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "memory", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="count, built-in name or module:factory")
    p.add_argument("--workers", "-n", type=int, default=8, help="data-parallel ranks N")
    p.add_argument("--optimizer", choices=("auto", *OPTIMIZERS), default="auto",
                   help="as gradsync train's: auto (adamw; sgd for mlp), adamw, sgd (momentum "
                   "0.9), sgd-plain (no momentum) (default: auto)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="as gradsync train's: fp32, bf16 or fp16 (16-bit parameters and "
                   "gradients, fp32 master copy) (default: fp32)")
    p.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                   help=argparse.SUPPRESS)  # before --precision existed; now the default
    p.add_argument("--fp32-grad-accum", action="store_true",
                   help="with --precision bf16 or fp16: keep an extra fp32 gradient (20P "
                   "with Adam; DeepSpeed's 2P+18P/N)")
    p.add_argument("--device-memory", metavar="SIZE", help="e.g. 80GB, 24GiB: fits verdict")
    g = p.add_argument_group("activations (transformer shape; give all of them)")
    g.add_argument("--micro-batch", type=int, default=1)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--checkpointing", choices=CHECKPOINTING, default="none",
                   help="none; selective (attention scores recomputed); full (the paper's: "
                   "each layer's input); block: what gradsync train --activation-checkpointing "
                   "does, full plus the one block being recomputed (default: none)")
    g.add_argument("--activation-checkpointing", dest="checkpointing", action="store_const",
                   const="block", help="as gradsync train's flag: --checkpointing block")
    h = p.add_argument_group("data loading (host memory, as gradsync train's --loader-workers)")
    h.add_argument("--loader-workers", type=int, default=None, metavar="N",
                   help="DataLoader worker processes: the micro-batches they hold ahead, and "
                   "their pinned copies on a GPU")
    h.add_argument("--sample-bytes", metavar="SIZE",
                   help="bytes of one sample (default with --seq-len: token data, 16 x seq-len: "
                   "input and target, 8 bytes a token each)")
    p.add_argument("--png", metavar="FILE", help="write a stacked bar chart")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run, command="plan memory")
    return p


def run(args) -> int:
    positive(args.workers, "--workers")
    if args.precision == "fp32" and args.fp32_grad_accum:
        raise UsageError("--fp32-grad-accum applies to mixed precision: add --precision bf16 "
                         "(or fp16)")
    count, source = resolve_param_count(args.model)
    optimizer = train_optimizer(args.optimizer, args.model)
    shape_flags = (args.seq_len, args.hidden, args.layers, args.heads)
    activation = None
    if any(v is not None for v in shape_flags):
        if any(v is None for v in shape_flags):
            raise UsageError("activation estimate needs --seq-len, --hidden, --layers and --heads")
        activation = ActivationShape(args.micro_batch, args.seq_len, args.hidden, args.layers,
                                     args.heads, args.checkpointing,
                                     ACTIVATION_ITEMSIZE[args.precision])
    device = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
    loader = None
    if args.loader_workers is not None or args.sample_bytes:
        positive(args.loader_workers or 0, "--loader-workers", allow_zero=True)
        sample = (parse_bytes(args.sample_bytes, "--sample-bytes") if args.sample_bytes
                  else 16 * args.seq_len if args.seq_len else None)
        if sample is None:
            raise UsageError("--loader-workers counts micro-batches of a sample's bytes: give "
                             "--sample-bytes SIZE, or --seq-len for token data")
        loader = loader_memory(args.loader_workers or 0, args.micro_batch, sample)
    plan = plan_memory(count, args.workers, optimizer, args.precision != "fp32",
                       args.fp32_grad_accum, activation, device, args.precision, loader)
    if args.json:
        print_json(plan)
    else:
        from ..observe.plan_tables import memory_table, print_table

        auto = " (--optimizer auto)" if args.optimizer == "auto" else ""
        print_table(memory_table(plan, source, f"{args.precision}, {optimizer}{auto}"))
    if args.png:
        from ..observe.plan_plots import memory_png

        memory_png(plan, args.png)
    return 0
