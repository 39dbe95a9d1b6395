"""`gradsync lighthouse`: torchft's lighthouse for a cluster job, with the settings derived from it.

The cluster form of fault-tolerant training (``docs/fault_tolerance.md``) needs one
lighthouse that every replica group reaches. Its settings follow from the job
(``ft/lighthouse.py``): a strict majority of ``--ft-groups`` as the quorum's
minimum, the run's ``--timeout`` as the join timeout (a quorum waits for every
group that heartbeats), a one-second heartbeat timeout. This command runs torchft's
own lighthouse server with them, in this process, and says each value and why;
``--print`` prints the equivalent ``torchft_lighthouse`` command line instead, for
a supervisor (systemd, a Kubernetes Deployment) that runs torchft's binary.
"""

from __future__ import annotations

import shlex
import signal
import threading

from ..errors import UsageError

EPILOG = """\
examples:
  gradsync lighthouse --ft-groups 3 --timeout 300              # serve on [::]:29510
  gradsync lighthouse --ft-groups 3 --timeout 300 --print      # torchft_lighthouse ... instead
Then on each group's host(s): torchrun ... -m gradsync.train --ft-groups 3 --ft-group i
  --ft-lighthouse LIGHTHOUSE_HOST:29510 --timeout 300 ... (the same --timeout)."""


def register(subparsers, help_line: str):
    import argparse

    p = subparsers.add_parser("lighthouse", help=help_line, description=help_line,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ft-groups", type=int, required=True, metavar="N",
                   help="the job's replica groups (gradsync train --ft-groups N)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="the job's gradsync train --timeout, seconds (default 300): the join "
                   "timeout's backstop")
    p.add_argument("--bind", default="[::]:29510",
                   help="HOST:PORT to serve on (default [::]:29510, torchft's)")
    p.add_argument("--print", action="store_true",
                   help="print the torchft_lighthouse command line with these settings and exit")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from ..ft.lighthouse import settings_for, start_lighthouse

    if args.ft_groups < 1:
        raise UsageError(f"--ft-groups must be >= 1, got {args.ft_groups}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    host, sep, port = args.bind.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--bind takes HOST:PORT, e.g. [::]:29510; got {args.bind!r}")
    settings = settings_for(args.ft_groups, args.timeout)
    if args.print:
        print(shlex.join(["torchft_lighthouse", *settings.argv(args.bind)]))
        return 0
    light = start_lighthouse(settings, host, int(port))
    print(f"gradsync lighthouse: serving {args.ft_groups} replica groups on {args.bind} "
          f"(status page: http://HOST:{port}/status)", flush=True)
    for line in settings.reasons():
        print(f"  {line}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        light.shutdown()
    return 0
