"""Replica groups on emulated hosts: one group per host, torchft's lighthouse on a host of its own.

The cluster form of fault-tolerant training (``docs/fault_tolerance.md``), on
netlab: host ``i < N`` runs ``gradsync train ... --ft-groups N --ft-group i
--ft-lighthouse http://LIGHTHOUSE:29510`` (its own launcher, workers and run
directory ``OUT/group-i``), host ``N`` runs ``torchft_lighthouse`` with a strict
majority as its ``--min_replicas``. Every byte between groups crosses the
emulated links; a group's own ranks talk over its host's loopback.

Each host also gets a hostname of its own (a UTS namespace whose hostname is the
host's address): torchft advertises its managers' and its state-transfer
server's addresses by ``socket.gethostname()``, which on one machine would name
the same host for everyone, so a healing group would fetch its state from
itself.

What can be done to a group while the job runs, for the chaos harness
(``chaos.py``) and by hand: SIGKILL one of its workers (its launcher restarts the
group's workers, ``--max-restarts``), kill the whole host (every process in its
namespace; :meth:`GroupsLab.replace` starts a new one, which resumes from the
group's last checkpoint and heals to the quorum's step), and partition it (its
link down, then up).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import UsageError
from ..ft.job_end import grace_left, group_dir, last_committed
from . import cleanup
from .links import IFACE, sh
from .processes import terminate

LIGHTHOUSE_PORT = 29510
DEFAULT_TIMEOUT_S = 300.0  # gradsync train's --timeout when the job's flags leave it out


def flag_value(flags: list[str], name: str, default: str) -> str:
    """The last value given to ``name`` in ``flags`` (argparse's rule: the last one wins)."""
    value = default
    for i, a in enumerate(flags):
        if a == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def uts_argv(addr: str, argv: list[str]) -> list[str]:
    """``argv`` in a UTS namespace of its own whose hostname is ``addr``."""
    return ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', addr,
            *map(str, argv)]


def lighthouse_binary() -> str:
    here = Path(sys.executable).parent / "torchft_lighthouse"
    if here.exists():
        return str(here)
    import shutil

    found = shutil.which("torchft_lighthouse")
    if not found:
        raise UsageError("torchft_lighthouse not found: pip install 'gradsync[ft]'")
    return found


class GroupsLab:
    """``groups`` replica groups on the first hosts of ``lab``, the lighthouse on its last.

    ``train_args``: `gradsync train`'s flags for every group (without ``--ft-*``,
    ``--out``); ``out``: the job's directory (group ``i`` writes ``out/group-i``,
    its output also goes to ``out/host-i.log``).
    """

    def __init__(self, lab, train_args: list[str], groups: int, out: str, *, workers: int = 1,
                 max_restarts: int = 3, env: dict | None = None, echo: bool = False):
        if lab.num_hosts != groups + 1:
            raise UsageError(f"{groups} replica groups need {groups + 1} emulated hosts "
                             f"(one for the lighthouse), the lab has {lab.num_hosts}")
        self.lab, self.groups, self.out = lab, groups, out
        self.train_args = [str(a) for a in train_args]
        self.workers, self.max_restarts = workers, max_restarts
        self.env, self.echo = dict(env or {}), echo
        self.procs: dict[int, subprocess.Popen] = {}
        self.lighthouse: subprocess.Popen | None = None
        self.starts = [0] * groups
        self._lock = threading.Lock()
        self._barrier = os.path.join(out, ".start")

    @property
    def lighthouse_addr(self) -> str:
        return f"http://{self.lab.hosts[self.groups].addr}:{LIGHTHOUSE_PORT}"

    def start(self) -> GroupsLab:
        os.makedirs(self.out, exist_ok=True)
        self.start_lighthouse()
        for g in range(self.groups):
            self.start_group(g)
        return self

    def start_lighthouse(self) -> None:
        """torchft's own binary, with the settings derived from the run (``ft/lighthouse.py``),
        as ``gradsync lighthouse --print`` gives them for a cluster."""
        from ..ft.lighthouse import settings_for

        host = self.lab.hosts[self.groups]
        timeout = float(flag_value(self.train_args, "--timeout", str(DEFAULT_TIMEOUT_S)))
        settings = settings_for(self.groups, timeout)
        argv = [lighthouse_binary(), *settings.argv(f"{host.addr}:{LIGHTHOUSE_PORT}")]
        self.lighthouse = self._popen(self.groups, argv, "lighthouse")

    def group_argv(self, g: int) -> list[str]:
        return [sys.executable, "-m", "gradsync", "train", *self.train_args,
                "--workers", str(self.workers), "--max-restarts", str(self.max_restarts),
                "--ft-groups", str(self.groups), "--ft-group", str(g),
                "--ft-lighthouse", self.lighthouse_addr, "--out", group_dir(self.out, g)]

    def start_group(self, g: int) -> None:
        """Start group ``g``'s launcher on host ``g`` (again, after :meth:`kill_host`)."""
        self.starts[g] += 1
        env = {"GRADSYNC_FT_BARRIER": self._barrier, **self.env}
        self.procs[g] = self._popen(g, self.group_argv(g), f"group {g}", env)

    def _popen(self, host: int, argv: list[str], name: str, env: dict | None = None):
        h = self.lab.hosts[host]
        log = open(os.path.join(self.out, f"host-{host}.log"), "a", encoding="utf-8")
        p = self.lab.popen(h, uts_argv(h.addr, argv), {**self.env, **(env or {})},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace")
        threading.Thread(target=self._relay, args=(p, log, name), daemon=True).start()
        return p

    def _relay(self, p: subprocess.Popen, log, name: str) -> None:
        with log:
            for line in p.stdout:
                log.write(line)
                log.flush()
                if self.echo:
                    with self._lock:
                        sys.stdout.write(f"[{name}] {line}")
                        sys.stdout.flush()

    # -- what the chaos harness does ---------------------------------------------------
    def worker_pids(self, g: int) -> list[int]:
        """Group ``g``'s live workers: forked by its launcher's forkserver (their
        ``/proc/PID/environ`` is the forkserver's), or started with ``LOCAL_RANK`` set."""
        def read(pid: int, what: str) -> bytes:
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    return f.read()
            except OSError:
                return b""

        out = []
        for pid in cleanup.pids_in(self.lab.hosts[g].netns):
            status = read(pid, "status").decode(errors="replace")
            ppid = next((int(v.split()[1]) for v in status.splitlines()
                         if v.startswith("PPid:")), 0)
            if (b"multiprocessing.forkserver" in read(ppid, "cmdline")
                    or b"\0LOCAL_RANK=" in b"\0" + read(pid, "environ")):
                out.append(pid)
        return sorted(out)

    def kill_worker(self, g: int, pick: int = 0) -> int | None:
        """SIGKILL one of group ``g``'s workers (``pick`` modulo their number); its launcher
        restarts the group's workers. The pid killed, or None (no worker running)."""
        pids = self.worker_pids(g)
        if not pids:
            return None
        pid = pids[pick % len(pids)]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def kill_host(self, g: int) -> None:
        """Every process on host ``g`` SIGKILLed at once: launcher, workers, servers."""
        ns = self.lab.hosts[g].netns
        for pid in cleanup.pids_in(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p = self.procs.get(g)
        if p is not None:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                cleanup.kill_inside(ns)

    def replace(self, g: int) -> None:
        """A new host for group ``g``: its launcher started again (it resumes and heals)."""
        self.start_group(g)

    def link(self, g: int, up: bool) -> None:
        """Host ``g``'s link down (a partition: nothing in or out) or up again."""
        sh("ip", "-n", self.lab.hosts[g].netns, "link", "set", IFACE, "up" if up else "down")

    def last_committed(self, g: int) -> int:
        return last_committed(self.out, g)

    # -- the end ----------------------------------------------------------------------
    def wait(self, steps: int, timeout: float) -> list[int | None]:
        """Every group's exit code (None: stopped), waiting at most ``timeout`` seconds;
        once a group finished every step, the others get ``ft/job_end.py``'s grace."""
        deadline = time.monotonic() + timeout
        finished_at = None
        while any(p.poll() is None for p in self.procs.values()):
            now = time.monotonic()
            if now > deadline:
                break
            if finished_at is None and any(p.poll() == 0 for p in self.procs.values()):
                finished_at = now
            if finished_at is not None:
                for g, p in self.procs.items():
                    if p.poll() is None and grace_left(self.out, g, steps,
                                                       now - finished_at) <= 0:
                        terminate(p)
            time.sleep(0.2)
        codes = []
        for g in range(self.groups):
            p = self.procs[g]
            if p.poll() is None:
                terminate(p)
                codes.append(None)
            else:
                codes.append(p.returncode)
        return codes

    def stop(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            if p is not None:
                terminate(p)
