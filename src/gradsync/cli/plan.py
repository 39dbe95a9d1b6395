"""`gradsync plan {memory,batch,comm}`: the pre-launch questions, one module each."""

from __future__ import annotations

import importlib

SUBCOMMANDS = [
    ("memory", "per-device memory of DP and ZeRO-1/2/3, activations, fits or not"),
    ("batch", "global batch in tokens -> samples and accumulation per worker count"),
    ("comm", "alpha-beta cost of ring/tree/hierarchical all-reduce vs a parameter server"),
]


def register(subparsers, help_line: str):
    parser = subparsers.add_parser(
        "plan", help=help_line, description=help_line + ". Pure maths: no process is started."
    )
    sub = parser.add_subparsers(dest="plan_command", metavar="WHAT")
    sub.required = True
    for name, line in SUBCOMMANDS:
        importlib.import_module(f"{__package__}.plan_{name}").register(sub, line)
    return parser
