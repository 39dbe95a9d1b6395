"""Removing emulated hosts: after a run, after a crash, and by ``gradsync netlab clean``.

Standard library only, and runnable as a script: ``Netlab`` starts this file as a
small watchdog process (``python cleanup.py --reap NAME_PREFIX``) that blocks on a
pipe from its parent. The parent closes the pipe after its own teardown; if the
parent dies first -- SIGKILL included, where no ``finally`` runs -- the pipe
closes anyway and the watchdog removes what the parent left.

Every namespace is named ``gsnl-<pid>-<start>-<k>-<role>`` (pid and start time of
the creating process, an instance counter, ``h<i>`` or ``sw``), so
``leftovers()`` can tell a live invocation's namespaces from a dead one's even
after the pid was reused. Deleting a namespace removes its veth ends and bridge
with it; processes still inside are killed first, because a namespace with
processes in it outlives its name (and its links with it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

NAME = re.compile(r"^gsnl-(\d+)-(\d+)-\d+-(?:h\d+|sw)$")


def _ip(*args: str, check: bool = True) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def list_namespaces() -> list[str]:
    """All gradsync netlab namespaces on this machine (any invocation)."""
    try:
        out = _ip("netns", "list", check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if NAME.match(n))


def _alive(name: str) -> bool:
    pid, started = map(int, NAME.match(name).groups())
    return start_time(pid) == started


def leftovers() -> list[str]:
    """Namespaces whose creating process is gone."""
    return [n for n in list_namespaces() if not _alive(n)]


def pids_in(ns: str) -> list[int]:
    try:
        out = _ip("netns", "pids", ns, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def kill_inside(ns: str, grace_s: float = 2.0) -> None:
    """SIGTERM every process in ``ns``, then SIGKILL what is left after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        pids = pids_in(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                if time.monotonic() > deadline + 5:
                    return  # unkillable (D state); the delete below still drops the name
            sig = signal.SIGKILL


def remove(names: list[str], grace_s: float = 2.0) -> list[str]:
    """Kill the processes inside, then delete the namespaces; returns those deleted."""
    for ns in names:
        kill_inside(ns, grace_s)
    gone = []
    for ns in names:
        try:
            _ip("netns", "del", ns, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        gone.append(ns)
    return gone


def with_prefix(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix)]


def _reap(prefix: str) -> int:
    """Watchdog: wait for the parent's pipe (stdin) to close, then remove ``prefix*``."""
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # a Ctrl-C meant for the parent must not stop this
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except OSError:
        pass
    remove(with_prefix(prefix))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reap":
        sys.exit(_reap(sys.argv[2]))
    print("usage: cleanup.py --reap NAME_PREFIX", file=sys.stderr)
    sys.exit(2)
