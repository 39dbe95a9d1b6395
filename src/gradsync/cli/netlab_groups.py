"""`gradsync netlab run --ft-groups N`: replica groups on emulated hosts, one per host.

N + 1 emulated hosts: host ``i < N`` runs ``gradsync train ... --ft-group i`` (its
own launcher and workers, ``--procs-per-host`` of them), host N runs torchft's
lighthouse (``netlab/groups.py``). ``--chaos W,H,P`` adds a seeded schedule of W
worker kills, H host kills and P partitions (``netlab/chaos.py``) during the
first 60% of ``--steps``. At the end, the per-group table of `gradsync train
--ft-groups` and the faults that fired.
"""

from __future__ import annotations

import os
import threading

from ..errors import UsageError
from ..netlab.groups import flag_value  # noqa: F401 - the one reading of a flag's value

CHAOS_SHARE = 0.6  # faults land in the first 60% of the steps: time to heal before the end


def train_flags(rest: list[str]) -> list[str]:
    """``-m gradsync.train FLAGS`` (netlab run's usual form) or ``FLAGS`` -> FLAGS."""
    if rest[:2] == ["-m", "gradsync.train"]:
        return rest[2:]
    if rest and not rest[0].startswith("--"):
        raise UsageError("--ft-groups runs gradsync train on every host: give its flags "
                         "after --, e.g. -- -m gradsync.train --model gpt --steps 200")
    return rest


def chaos_counts(spec: str | None) -> tuple[int, int, int]:
    if not spec:
        return 0, 0, 0
    parts = spec.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"--chaos takes W,H,P (worker kills, host kills, partitions), "
                         f"e.g. 3,1,1; got {spec!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def run_groups(args, rest: list[str]) -> int:
    from ..netlab import Netlab, chaos
    from ..netlab.groups import GroupsLab
    from .train_groups_table import print_table

    flags = train_flags(rest)
    for own in ("--ft-groups", "--ft-group", "--ft-lighthouse", "--workers"):
        if any(a == own or a.startswith(own + "=") for a in flags):
            raise UsageError(f"{own} is set by netlab run --ft-groups (and --procs-per-host); "
                             "leave it out of gradsync train's flags")
    groups, out = args.ft_groups, flag_value(flags, "--out", "runs/netlab-groups")
    steps = int(flag_value(flags, "--steps", "0") or 0)
    w, h, p = chaos_counts(args.chaos)
    faults = []
    if w + h + p:
        if steps < 10:
            raise UsageError("--chaos needs gradsync train's --steps (at least 10) to place "
                             "its faults")
        faults = chaos.plan(args.chaos_seed, groups, 3, max(3 + w + h + p,
                                                            int(steps * CHAOS_SHARE)),
                            workers=w, hosts=h, partitions=p)
    flags = [a for i, a in enumerate(flags) if a != "--out" and not a.startswith("--out=")
             and not (i and flags[i - 1] == "--out")]
    print(f"netlab: {groups} replica groups of {args.procs_per_host} worker(s), one per host, "
          f"the lighthouse on host {groups}; links {args.rate} each way; run directories "
          f"{out}/group-*", flush=True)
    with Netlab(groups + 1, args.rate, burst=args.burst) as lab:
        job = GroupsLab(lab, flags, groups, os.path.abspath(out), workers=args.procs_per_host,
                        max_restarts=args.max_restarts, echo=not args.quiet).start()
        fired: list = []
        thread = threading.Thread(target=lambda: fired.extend(chaos.unleash(job, faults)),
                                  daemon=True)
        thread.start()
        codes = job.wait(steps or 10 ** 9, args.timeout)
        thread.join(timeout=30)
        job.stop()
    print_table(out, codes)
    for f in fired:
        print(f"chaos: {f.fault.kind} on group {f.fault.group} at job step {f.job_step} "
              f"({f.t_s:.1f} s): {f.note}")
    return 0 if 0 in codes else 1
