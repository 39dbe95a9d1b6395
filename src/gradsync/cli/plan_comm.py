"""`gradsync plan comm MODEL`: what communication costs per step, by pattern and N."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..plan.comm import plan_comm
from ..plan.memory import resolve_param_count
from ..plan.units import parse_int_list, parse_rate, parse_time
from ._common import positive, print_json

EPILOG = """\
Units: GB = 1e9 bytes, GB/s = 1e9 bytes/s (a bare bandwidth number means GB/s).
With --links (the file `gradsync netlab calibrate` writes): every algorithm priced round
by round on the two measured links (plan.two_level), hosts of --per-node ranks (default:
as measured); --bandwidth, --latency and --intra-bandwidth do not apply.
  gradsync plan comm gpt --itemsize 4 --links links.json --workers 4,8,16
example (parameter server vs ring, 2e9 fp16 gradients): gradsync plan comm 2e9 --itemsize 2
  --bandwidth 25GB/s --workers 8,64,512   -> PS ingress 1.28/10.24/81.92 s,
  ring all-reduce 0.28/0.315/0.319 s"""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "comm", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="count (2e9, 7B), built-in or module:factory")
    p.add_argument("--itemsize", type=int, default=2, help="bytes per gradient element")
    p.add_argument("--workers", default="8,64,512", help="comma-separated worker counts")
    p.add_argument("--bandwidth", default="25GB/s", help="per-link (inter-node) bandwidth")
    p.add_argument("--latency", default="0", help="alpha per message: 5us, 0.1ms")
    p.add_argument("--per-node", type=int, help="workers per node (adds hierarchical)")
    p.add_argument("--intra-bandwidth", help="intra-node bandwidth for hierarchical")
    p.add_argument("--links", metavar="FILE",
                   help="intra/inter-host alpha-beta from `gradsync netlab calibrate`")
    p.add_argument("--png", metavar="FILE", help="write time vs workers plot")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run, command="plan comm")
    return p


def run(args) -> int:
    positive(args.itemsize, "--itemsize")
    positive(args.per_node, "--per-node")
    count, _ = resolve_param_count(args.model)
    if args.links:
        return _run_links(args, count)
    intra = parse_rate(args.intra_bandwidth, "--intra-bandwidth") if args.intra_bandwidth else None
    plan = plan_comm(
        count, args.itemsize, parse_int_list(args.workers, "--workers"),
        parse_rate(args.bandwidth, "--bandwidth"), parse_time(args.latency, "--latency"),
        args.per_node, intra,
    )
    return _show(args, plan, "comm_table", "comm_png")


def _run_links(args, count: int) -> int:
    """The two-level prediction with measured links."""
    from ..calibrate.links import calibration_from_json
    from ..plan.two_level import plan_two_level

    try:
        with open(args.links, encoding="utf-8") as f:
            cal = calibration_from_json(f.read())
    except OSError as e:
        raise UsageError(f"--links {args.links}: {e.strerror or e}") from None
    except UsageError as e:
        raise UsageError(f"--links {args.links}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--links {args.links} is not a links file from `gradsync netlab "
                         f"calibrate` ({type(e).__name__}: {e})") from None
    topo = cal.topology(ranks_per_host=args.per_node)
    plan = plan_two_level(float(count) * args.itemsize,
                          parse_int_list(args.workers, "--workers"), topo.ranks_per_host,
                          topo.intra, topo.inter)
    return _show(args, plan, "two_level_table", "two_level_png")


def _show(args, plan, table: str, png: str) -> int:
    """``plan`` as JSON or as ``observe.plan_tables.<table>``, and ``plan_plots.<png>``
    with ``--png`` (renderers imported only when used: the planner starts without them)."""
    if args.json:
        print_json(plan)
    else:
        from ..observe import plan_tables

        plan_tables.print_table(getattr(plan_tables, table)(plan))
    if args.png:
        from ..observe import plan_plots

        getattr(plan_plots, png)(plan, args.png)
    return 0
