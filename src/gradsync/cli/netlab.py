"""`gradsync netlab`: emulated hosts on this machine -- run, calibrate, check, clean.

Hosts are network namespaces joined by veth links rate-limited with ``tc tbf``
in both directions (docs/netlab.md says what is and is not emulated); ``run``
starts one torchrun agent per host, so the job is a real multi-node run across
the emulated links. Everything needs root; without it every subcommand says so
in one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ..errors import UsageError

EPILOG = """\
examples:
  gradsync netlab check
  gradsync netlab run --hosts 2 --rate 100mbit -- -m gradsync.train --model mlp --steps 5
  gradsync netlab run --hosts 3 --rate 1gbit -- my_script.py --flag
  gradsync netlab run --ft-groups 3 --chaos 3,1,1 -- -m gradsync.train --model gpt --steps 300
  gradsync netlab calibrate --hosts 2 --procs-per-host 2 --rate 100mbit --png links.png
  gradsync netlab clean          # remove namespaces left by killed invocations
Rates are tc's: 100mbit, 400mbit, 1gbit (bits per second; also 12.5MB/s)."""


def _lab_flags(p, hosts_default: int = 2) -> None:
    p.add_argument("--hosts", type=int, default=hosts_default, help="emulated hosts (2..64)")
    p.add_argument("--procs-per-host", type=int, default=1,
                   help="torchrun workers per host (--nproc-per-node)")
    p.add_argument("--rate", default="100mbit",
                   help="each host link's rate, each direction (tc units: 100mbit, 1gbit)")
    p.add_argument("--burst", default="32kb", help="token-bucket burst of the tbf (default 32kb)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before every host's processes are stopped (default 600)")


def register(subparsers, help_line: str):
    p = subparsers.add_parser("netlab", help=help_line, description=help_line, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="netlab_command", metavar="SUBCOMMAND")
    sub.required = True

    r = sub.add_parser("run", help="run torchrun ARGS on every emulated host (multi-node)",
                       description="One torchrun agent per emulated host; ARGS follow `--`.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _lab_flags(r)
    r.add_argument("--quiet", action="store_true", help="do not stream the hosts' output")
    r.add_argument("--ft-groups", type=int, default=0, metavar="N",
                   help="fault-tolerant replica groups: N hosts run one `gradsync train "
                   "--ft-group i` each (--procs-per-host workers), one more runs torchft's "
                   "lighthouse (N + 1 hosts: --hosts is not used); ARGS are gradsync "
                   "train's flags (docs/fault_tolerance.md)")
    r.add_argument("--max-restarts", type=int, default=3,
                   help="with --ft-groups: restarts of a group's workers (default 3)")
    r.add_argument("--chaos", metavar="W,H,P",
                   help="with --ft-groups: W worker kills, H host kills, P partitions (8 s) "
                   "at random steps in the first 60%% of --steps")
    r.add_argument("--chaos-seed", type=int, default=0, help="seed of the --chaos schedule")
    r.add_argument("args", nargs=argparse.REMAINDER,
                   help="-- then torchrun's script part: -m MODULE ... or SCRIPT.py ...")
    r.set_defaults(run=run_run)

    c = sub.add_parser("calibrate", help="measure intra- and inter-host alpha/beta on netlab",
                       description="Time exchanges inside a host and across the emulated link, "
                       "fit alpha/beta per link, print the two-level all-reduce predictions.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _lab_flags(c)
    c.set_defaults(procs_per_host=2)
    c.add_argument("--quick", action="store_true",
                   help="4 KB..4 MB in 5 sizes (default 4 KB..16 MB in 7)")
    c.add_argument("--reps", type=int, default=5, help="repetitions per size (default 5)")
    c.add_argument("--out", default="links.json", metavar="FILE",
                   help="the link calibration, JSON (default links.json)")
    c.add_argument("--png", metavar="FILE", help="measured points and fitted lines")
    c.set_defaults(run=run_calibrate)

    k = sub.add_parser("check", help="can netlab run here? (root, ip, tc, namespaces, tbf)")
    k.set_defaults(run=run_check)
    cl = sub.add_parser("clean", help="remove namespaces left by netlab invocations that died")
    cl.set_defaults(run=run_clean)
    return p


def _require() -> None:
    from ..netlab import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise UsageError(reason)


def _lab(args):
    from ..netlab import Netlab

    if not isinstance(args.procs_per_host, int) or args.procs_per_host < 1:
        raise UsageError(f"--procs-per-host must be >= 1, got {args.procs_per_host}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    return Netlab(args.hosts, args.rate, burst=args.burst)


def _exit_code(results) -> int:
    if any(r.timed_out for r in results):
        return 124
    codes = [r.returncode for r in results if r.returncode not in (0, None)]
    if codes:
        return codes[0]
    return 0 if all(r.returncode == 0 for r in results) else 1


def run_run(args) -> int:
    rest = list(args.args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise UsageError("nothing to run: give torchrun's script part after --, "
                         "e.g. -- -m gradsync.train --model mlp")
    _require()
    if args.ft_groups:
        from .netlab_groups import run_groups

        if args.ft_groups < 2:
            raise UsageError(f"--ft-groups must be >= 2 (one group per host), got "
                             f"{args.ft_groups}")
        _lab(args)  # the flags' own checks
        return run_groups(args, rest)
    if args.chaos:
        raise UsageError("--chaos needs --ft-groups N (faults are survived by replica groups)")
    lab = _lab(args)
    from ..netlab.view import results_table
    from ..observe.plan_tables import print_table

    print(f"netlab: {args.hosts} hosts x {args.procs_per_host} workers, links {args.rate} "
          "each way", flush=True)
    with lab:
        results = lab.torchrun(rest, args.procs_per_host, timeout=args.timeout,
                               echo=not args.quiet)
    print_table(results_table(results))
    return _exit_code(results)


def run_calibrate(args) -> int:
    from ..calibrate.links import calibration_to_json, default_link_sizes, summarise

    if args.reps < 1:
        raise UsageError(f"--reps must be >= 1, got {args.reps}")
    if args.hosts is None or args.hosts < 2:
        raise UsageError(f"--hosts must be >= 2 (the inter-host link needs two), got {args.hosts}")
    _require()
    lab = _lab(args)
    import json

    from rich.console import Console

    from ..netlab.view import links_png, links_table, prediction_table
    from ..observe.plan_tables import print_table

    sizes = default_link_sizes(args.quick)
    with tempfile.TemporaryDirectory(prefix="gradsync-links-") as tmp:
        raw = os.path.join(tmp, "payload.json")
        with Console(stderr=True).status(f"timing exchanges on {args.hosts} emulated hosts "
                                         f"at {args.rate} ..."), lab:
            results = lab.torchrun(["-m", "gradsync.calibrate.links", "--out", raw, "--reps",
                                    args.reps, "--sizes", ",".join(map(str, sizes))],
                                   args.procs_per_host, timeout=args.timeout)
        if _exit_code(results) or not os.path.exists(raw):
            from ..netlab.view import results_table

            print_table(results_table(results))
            tail = (results[0].stderr or results[0].stdout).strip().splitlines()[-20:]
            print("\n".join(tail), file=sys.stderr)
            print("gradsync netlab calibrate: error: the measurement failed (above)",
                  file=sys.stderr)
            return 1
        with open(raw, encoding="utf-8") as f:
            cal = summarise(json.load(f), rate=args.rate)
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(calibration_to_json(cal))
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror}") from None
    print_table(links_table(cal))
    print_table(prediction_table(cal.topology(), [64e3, 1e6, 32e6]))
    if args.png:
        links_png(cal, args.png)
    print(f"wrote {args.out}")
    return 0


def run_check(args) -> int:
    import shutil
    import subprocess

    from ..netlab import Netlab, leftovers, unavailable_reason
    from ..netlab.view import check_table
    from ..observe.plan_tables import print_table

    rows = [("root (CAP_NET_ADMIN)", os.geteuid() == 0, f"euid {os.geteuid()}")]
    for tool in ("ip", "tc"):
        path = shutil.which(tool)
        rows.append((f"'{tool}' command", path is not None, path or "not on PATH"))
    usable = unavailable_reason() is None
    if usable:
        try:
            with Netlab(2, "1gbit") as lab:
                ns = lab.hosts[0].netns
                rows.append(("namespaces, veth, tbf", True, "built and removed 2 hosts"))
                r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root",
                                    "netem", "delay", "1ms"], capture_output=True, text=True,
                                   timeout=30)
                rows.append(("netem (propagation delay)", True if r.returncode == 0 else None,
                             "available" if r.returncode == 0 else
                             "not in this kernel: latency is not emulated"))
        except UsageError as e:
            usable = False
            rows.append(("namespaces, veth, tbf", False, str(e)[:100]))
        dead = leftovers()
        rows.append(("leftovers of dead runs", not dead or None,
                     f"{len(dead)} namespaces (gradsync netlab clean)" if dead else "none"))
    print_table(check_table(rows))
    if not usable:
        raise UsageError(unavailable_reason() or "netlab cannot build hosts here (see above)")
    return 0


def run_clean(args) -> int:
    _require()
    from ..netlab.cleanup import leftovers, remove

    dead = leftovers()
    removed = remove(dead)
    for ns in removed:
        print(f"removed {ns}")
    print(f"{len(removed)} namespaces of dead netlab invocations removed")
    return 0
