"""`gradsync train --ft-groups N` on one machine: a lighthouse here and N replica groups.

Each group is its own ``gradsync train`` job (``cli/train_group.py``: its own launcher,
its own run directory ``OUT/group-i``), handed the config this command resolved with
its group's index, the lighthouse and its directory filled in -- the object itself,
never a command line to parse again. So a failure restarts only that group's workers
(``--max-restarts``, per group), which heal from a live peer at the next quorum;
the other groups never restart. The lighthouse runs in this process with the
settings derived from the run (``ft/lighthouse.py``): a quorum needs a strict
majority of the groups (no two quorums can train side by side; ``--ft-min-groups``
is not a flag on purpose: a smaller quorum could split the job in two) and waits
for every group that heartbeats.

Every group's output is passed through prefixed with its name, and at the end a
table says, per group, the steps it committed, the steps it redid, the times it
healed and the seconds lost. ``GRADSYNC_FT_FAULT`` (``GROUP/RANK:STEP:KIND,...``)
hands each group its own ``GRADSYNC_FAULT``, for trying failures.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import UsageError
from ..ft.job_end import grace_left, group_dir, last_committed

FAULT_ENV = "GRADSYNC_FT_FAULT"


def group_faults(spec: str, groups: int) -> dict[int, str]:
    """``"1/0:6:kill,2/0:9:kill"`` -> ``{1: "0:6:kill", 2: "0:9:kill"}``."""
    out: dict[int, list[str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        group, sep, fault = part.partition("/")
        if not sep or not group.isdigit() or not 0 <= int(group) < groups:
            raise UsageError(f"{FAULT_ENV}: {part!r} is not GROUP/RANK:STEP:KIND with GROUP in "
                             f"0..{groups - 1}")
        out.setdefault(int(group), []).append(fault)
    return {g: ",".join(f) for g, f in out.items()}


def send_job(proc, cfg, argv: list[str], out: str) -> None:
    """Hand ``proc`` (a ``python -m gradsync.cli.train_group`` just started) its job: the
    group's config, the command as given and the run directory it names, pickled over
    the pipe this launcher opened to its own child (``cli/train_group.py``)."""
    proc.stdin.buffer.write(pickle.dumps((cfg, list(argv), out)))
    proc.stdin.close()


def group_config(cfg, group: int, lighthouse: str):
    """Group ``group``'s config: the launcher's, resolved once, with its own group index,
    lighthouse and run directory (``OUT/group-i``) and a free port of its own."""
    return dataclasses.replace(
        cfg, ft=dataclasses.replace(cfg.ft, group=group, lighthouse=lighthouse),
        run=dataclasses.replace(cfg.run, out=group_dir(cfg.run.out, group), port=0))


def _relay(proc: subprocess.Popen, name: str, lock: threading.Lock) -> None:
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def _wait(procs: list, cfg, barrier: str) -> list[int]:
    """Every group's exit code; once one group has finished every step, the others get
    the grace of ``ft/job_end.py`` and are then stopped. A group whose launcher exited is
    marked gone in ``barrier``: the finished groups' closing rounds (``ft/closing.py``)
    do not wait for it."""
    from ..ft.closing import mark_gone

    finished_at, marked = None, set()
    while any(p.poll() is None for p, _ in procs):
        for g, (p, _) in enumerate(procs):
            if p.poll() is not None and g not in marked:
                marked.add(g)
                mark_gone(barrier, g)
        if finished_at is None and any(p.poll() == 0 for p, _ in procs):
            finished_at = time.monotonic()
        if finished_at is not None:
            waited = time.monotonic() - finished_at
            for g, (p, _) in enumerate(procs):
                if p.poll() is not None:
                    continue
                if grace_left(cfg.run.out, g, cfg.run.steps, waited) <= 0:
                    done = last_committed(cfg.run.out, g) >= cfg.run.steps
                    print(f"gradsync train: stopping group {g}: another group finished every "
                          f"step {waited:.0f} s ago"
                          + ("" if done else " and this one is not in the last quorum"),
                          flush=True)
                    p.terminate()
        time.sleep(0.2)
    codes = [p.wait() for p, _ in procs]
    for _, relay in procs:
        relay.join(timeout=5)
    return codes


def run_groups(cfg, argv: list[str]) -> int:
    """Start the lighthouse and the groups, relay their output, wait; 0 if a group finished."""
    from ..ft.lighthouse import settings_for, start_lighthouse
    from .train_groups_table import print_table

    faults = group_faults(os.environ.get(FAULT_ENV, ""), cfg.ft.groups)
    light = start_lighthouse(settings_for(cfg.ft.groups, cfg.run.timeout))
    print(f"gradsync train: lighthouse at {light.address} (quorum: at least "
          f"{light.min_groups} of {cfg.ft.groups} groups); {cfg.ft.groups} replica groups of "
          f"{cfg.run.workers} worker{'' if cfg.run.workers == 1 else 's'} in {cfg.run.out}/group-*",
          flush=True)
    procs, lock = [], threading.Lock()
    barrier = tempfile.mkdtemp(prefix="gradsync-ft-start-")
    try:
        for g in range(cfg.ft.groups):
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            env.pop(FAULT_ENV, None)
            env["GRADSYNC_FT_BARRIER"] = barrier  # a fresh job's first quorum holds every group
            if g in faults:
                env["GRADSYNC_FAULT"] = faults[g]
            proc = subprocess.Popen([sys.executable, "-m", "gradsync.cli.train_group"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)
            send_job(proc, group_config(cfg, g, light.address), argv, cfg.run.out)
            relay = threading.Thread(target=_relay, args=(proc, f"group {g}", lock), daemon=True)
            relay.start()
            procs.append((proc, relay))
        codes = _wait(procs, cfg, barrier)
    except KeyboardInterrupt:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait()
        print(f"\ngradsync train: interrupted; the same command continues from each group's "
              f"last checkpoint in {cfg.run.out}/group-*", file=sys.stderr)
        return 130
    finally:
        light.shutdown()
        shutil.rmtree(barrier, ignore_errors=True)
    print_table(cfg.run.out, codes)
    return 0 if 0 in codes else 1
