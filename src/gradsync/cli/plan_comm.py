"""`gradsync plan comm MODEL`: what communication costs per step, by pattern and N.

Defaults follow what `gradsync train` sends: 4-byte gradients (it all-reduces fp32
gradients, ``--precision bf16`` runs included). Latency and bandwidth come from what
the user gives (``--latency``, ``--bandwidth``), else from a profile measured by
``gradsync calibrate`` (``--profile``), else from stated assumptions (alpha 0, 25 GB/s):
the output says which, so a number nobody measured never passes for one.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import UsageError
from ..plan.comm import link_from_profile, plan_comm
from ..plan.memory import resolve_param_count
from ..plan.units import parse_int_list, parse_rate, parse_time
from ._common import positive, print_json

EPILOG = """\
Units: GB = 1e9 bytes, GB/s = 1e9 bytes/s (a bare bandwidth number means GB/s).
Defaults: 4-byte gradients (gradsync train all-reduces fp32 gradients in both
precisions; --itemsize 2 for --compress bf16); link and latency from --profile (the
file `gradsync calibrate` writes: its all-reduce alpha spread over the ring's 2(N-1)
messages, and its bandwidth), else assumed 25 GB/s and alpha 0, said in the output.
With --links (the file `gradsync netlab calibrate` writes): every algorithm priced round
by round on the two measured links (plan.two_level), hosts of --per-node ranks (default:
as measured); --bandwidth, --latency, --intra-bandwidth and --profile are refused.
  gradsync plan comm gpt --links links.json --workers 4,8,16
example (parameter server vs ring, 2e9 fp16 gradients): gradsync plan comm 2e9 --itemsize 2
  --bandwidth 25GB/s --workers 8,64,512   -> PS ingress 1.28/10.24/81.92 s,
  ring all-reduce 0.28/0.315/0.319 s"""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "comm", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="count (2e9, 7B), built-in or module:factory")
    p.add_argument("--itemsize", type=int, help="bytes per gradient element (default: 4, "
                   "the fp32 gradients gradsync train all-reduces)")
    p.add_argument("--workers", default="8,64,512", help="comma-separated worker counts")
    p.add_argument("--bandwidth", help="per-link (inter-node) bandwidth (default: --profile's, "
                   "else 25GB/s assumed)")
    p.add_argument("--latency", help="alpha per message: 5us, 0.1ms (default: --profile's, "
                   "else 0 assumed)")
    p.add_argument("--profile", metavar="FILE",
                   help="alpha and bandwidth measured by `gradsync calibrate --out FILE`")
    p.add_argument("--per-node", type=int, help="workers per node (adds hierarchical)")
    p.add_argument("--intra-bandwidth", help="intra-node bandwidth for hierarchical")
    p.add_argument("--links", metavar="FILE",
                   help="intra/inter-host alpha-beta from `gradsync netlab calibrate`")
    p.add_argument("--png", metavar="FILE", help="write time vs workers plot")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run, command="plan comm")
    return p


DEFAULT_ITEMSIZE = 4
DEFAULT_BANDWIDTH = "25GB/s"


def run(args) -> int:
    positive(args.itemsize, "--itemsize")
    positive(args.per_node, "--per-node")
    count, _ = resolve_param_count(args.model)
    if args.links:
        given = [f for f, v in (("--bandwidth", args.bandwidth), ("--latency", args.latency),
                                ("--intra-bandwidth", args.intra_bandwidth),
                                ("--profile", args.profile)) if v is not None]
        if given:
            raise UsageError(f"{given[0]} does not apply with --links (both links' alpha and "
                             "bandwidth come from the file); drop one of them")
        return _run_links(args, count)
    intra = parse_rate(args.intra_bandwidth, "--intra-bandwidth") if args.intra_bandwidth else None
    itemsize, bandwidth, alpha, notes = _link_figures(args)
    plan = plan_comm(count, itemsize, parse_int_list(args.workers, "--workers"), bandwidth,
                     alpha, args.per_node, intra)
    return _show(args, dataclasses.replace(plan, notes=tuple(notes)), "comm_table", "comm_png")


def _link_figures(args) -> tuple[int, float, float, list[str]]:
    """(itemsize, bandwidth, alpha, notes): each figure given, measured or assumed, and
    the notes that say which for every one not given."""
    notes = []
    itemsize = args.itemsize
    if itemsize is None:
        itemsize = DEFAULT_ITEMSIZE
        notes.append("gradients: 4 B a value, the fp32 gradients gradsync train all-reduces "
                     "(bf16 runs too); --itemsize 2 for --compress bf16/fp16")
    measured = None
    if args.profile:
        from ..plan.profile import load_profile

        prof = load_profile(args.profile)
        try:
            measured = link_from_profile(prof.alpha_s, prof.beta_s_per_byte, prof.world_size)
        except UsageError as e:
            raise UsageError(f"--profile {args.profile}: {e}") from None
        where = f"measured by gradsync calibrate on {prof.world_size} workers ({args.profile})"
    if args.bandwidth is not None:
        bandwidth = parse_rate(args.bandwidth, "--bandwidth")
    elif measured:
        bandwidth = measured[1]
        notes.append(f"bandwidth: {where}")
    else:
        bandwidth = parse_rate(DEFAULT_BANDWIDTH, "--bandwidth")
        notes.append(f"bandwidth: {DEFAULT_BANDWIDTH} assumed; give --bandwidth, or --profile "
                     "from gradsync calibrate")
    if args.latency is not None:
        alpha = parse_time(args.latency, "--latency")
    elif measured:
        alpha = measured[0]
        notes.append(f"latency: {where}, its all-reduce alpha over the ring's "
                     f"{2 * (prof.world_size - 1)} messages")
    else:
        alpha = 0.0
        notes.append("latency: 0 assumed (every message's alpha ignored, which flatters "
                     "large N); give --latency, or --profile from gradsync calibrate")
    return itemsize, bandwidth, alpha, notes


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
    plan = plan_two_level(float(count) * (args.itemsize or DEFAULT_ITEMSIZE),
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
