"""Emulated hosts on one machine: network namespaces joined by rate-limited veth links.

What is emulated, and what is not (this kernel has no ``netem``):

* **Bandwidth and queueing** of each host's link, in both directions: ``tbf`` on
  both ends of every host's veth, hosts joined directly (two) or through a bridge
  (more); ``links.py`` says how, and what goodput it gives here.
* **Not propagation delay**: without netem there is no added latency, so alpha
  is this machine's (sub-millisecond) rather than a real network's.
* **Not separate CPUs**: every host's ranks share this machine's cores; the
  figures are about the link, not the compute.
* Ranks inside one host talk over the host's own loopback (a connection to one's
  own address is routed through ``lo``), which is not rate-limited.

This module is the lifetime of one emulated network: built on entry, torn down
on exit, after Ctrl-C, SIGTERM and SIGHUP too, and by a watchdog if this process
is killed outright. Names carry the creating process's pid and start time
(cleanup.py); running commands on the hosts is ``processes.py``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import UsageError
from ..plan.units import parse_bytes
from . import cleanup, links
from .links import IFACE, Host, tc_rate
from .processes import HostResult, run_all, terminate

__all__ = ["Host", "HostResult", "Netlab", "NetlabUnavailable", "tc_rate", "unavailable_reason"]

_instances = itertools.count()


class NetlabUnavailable(UsageError):
    """No root, or no ``ip``/``tc``: the emulated network cannot be built here."""


def unavailable_reason() -> str | None:
    """Why netlab cannot run here, or None (cheap: no namespace is created)."""
    if os.geteuid() != 0:
        return "netlab needs root (ip netns, veth and tc need CAP_NET_ADMIN); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netlab needs the '{tool}' command (iproute2), not found on PATH"
    return None


class Netlab:
    """``hosts`` emulated hosts whose links run at ``rate`` each way.

    >>> with Netlab(hosts=2, rate="100mbit") as lab:          # doctest: +SKIP
    ...     results = lab.torchrun(["-m", "gradsync.train", "--model", "mlp"],
    ...                            procs_per_host=1, timeout=600)

    ``rate``: tc-style ('100mbit', '1gbit') or anything ``plan.units.parse_rate``
    reads. ``burst``/``latency``: the tbf's bucket and queue (links.py).
    Set up on ``__enter__`` (or ``up()``), torn down on ``__exit__`` (``down()``),
    after Ctrl-C, SIGTERM and SIGHUP too; a watchdog process removes everything if
    this process is killed outright.
    """

    def __init__(self, hosts: int = 2, rate="100mbit", *, burst: str = "32kb",
                 latency: str = "50ms", subnet: str = "10.213.0"):
        if not isinstance(hosts, int) or isinstance(hosts, bool) or not 2 <= hosts <= 64:
            raise UsageError(f"--hosts must be an integer from 2 to 64, got {hosts!r}")
        self.num_hosts = hosts
        self.rate_bytes_per_s, self._tc_rate = tc_rate(rate)
        self.rate = str(rate)
        self._burst = f"{round(parse_bytes(burst, 'burst'))}b"
        self._latency = str(latency)
        me = os.getpid()
        self.prefix = f"gsnl-{me}-{cleanup.start_time(me)}-{next(_instances)}-"
        self.hosts = tuple(Host(i, f"{self.prefix}h{i}", IFACE, f"{subnet}.{10 + i}")
                           for i in range(hosts))
        self.switch = f"{self.prefix}sw" if hosts > 2 else None
        self._reaper: subprocess.Popen | None = None
        self._procs: list[subprocess.Popen] = []
        self._saved_handlers: dict = {}
        self._up = False

    # -- set-up and teardown ---------------------------------------------------------
    def __enter__(self) -> Netlab:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts] + ([self.switch] if self.switch else [])

    def up(self) -> Netlab:
        reason = unavailable_reason()
        if reason:
            raise NetlabUnavailable(reason)
        self._install_signal_handlers()
        self._reaper = subprocess.Popen(
            [sys.executable, str(Path(cleanup.__file__)), "--reap", self.prefix],
            stdin=subprocess.PIPE, start_new_session=True)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        links.build(self.hosts, self.switch,
                    ("rate", self._tc_rate, "burst", self._burst, "latency", self._latency))

    def down(self) -> None:
        """Stop every process started here, remove the namespaces; idempotent."""
        if not self._up:
            return
        try:
            for p in self._procs:
                terminate(p)
            self._procs = []
            existing = set(cleanup.with_prefix(self.prefix))
            cleanup.remove([ns for ns in self.namespaces if ns in existing])
        finally:
            self._up = False
            if self._reaper is not None:
                try:
                    self._reaper.stdin.close()  # it finds nothing left and exits
                    self._reaper.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    pass
                self._reaper = None
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGHUP become SystemExit in the main thread, so ``finally`` tears down."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, _frame):
            raise SystemExit(128 + signum)

        for s in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[s] = signal.signal(s, stop)

    def _restore_signal_handlers(self) -> None:
        for s, h in self._saved_handlers.items():
            signal.signal(s, h)
        self._saved_handlers = {}

    def link_bytes(self) -> list[tuple[int, int]]:
        """(sent, received) bytes so far on every host's link (``links.link_bytes``):
        the traffic that crossed the emulated network, measured, not computed."""
        return [links.link_bytes(h) for h in self.hosts]

    # -- running things inside ----------------------------------------------------------
    def popen(self, host: int | Host, argv, env: dict | None = None, **kwargs):
        """Start ``argv`` inside host ``host``'s namespace (in a session of its own)."""
        if not self._up:
            raise UsageError("netlab is not up (use it as a context manager)")
        h = host if isinstance(host, Host) else self.hosts[host]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "GLOO_SOCKET_IFNAME": h.iface, **(env or {})}
        p = subprocess.Popen(["ip", "netns", "exec", h.netns, *map(str, argv)], env=full_env,
                             start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, commands, timeout: float, env: dict | None = None, echo: bool = False,
            grace_s: float = 15.0) -> list[HostResult]:
        """Run one command per host at once; wait for all, at most ``timeout`` seconds.

        ``commands``: a list of argv (one per host) or a function ``Host -> argv``.
        ``echo``: also print each output line as it comes, prefixed ``[hI]``. When a
        host's command fails, the others get ``grace_s`` seconds to finish (a peer of
        a failed multi-node job usually cannot) and are then stopped.
        """
        argvs = [commands(h) for h in self.hosts] if callable(commands) else list(commands)
        if len(argvs) != self.num_hosts:
            raise UsageError(f"netlab.run: {len(argvs)} commands for {self.num_hosts} hosts")
        results, ended = run_all(self.popen, self.hosts, argvs, self.namespaces, timeout, env,
                                 echo, grace_s)
        self._procs = [p for p in self._procs if p not in ended]
        return results

    def torchrun_argv(self, host: Host, procs_per_host: int, args, port: int = 29500,
                      run_id: str | None = None) -> list[str]:
        """One torchrun agent for ``host``: rendezvous at host 0 across the emulated link."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.num_hosts),
                "--nproc-per-node", str(procs_per_host), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.hosts[0].addr}:{port}",
                "--rdzv-id", run_id or self.prefix.rstrip("-"), "--max-restarts", "0",
                "--local-addr", host.addr]
        if host.index == 0:
            argv += ["--rdzv-conf", "is_host=1"]
        return argv + [str(a) for a in args]

    def torchrun(self, args, procs_per_host: int = 1, timeout: float = 600.0,
                 env: dict | None = None, echo: bool = False) -> list[HostResult]:
        """``torchrun ... ARGS`` on every host (a multi-node run over the emulated link).

        ``args``: what follows torchrun's own options, e.g. ``["-m", "gradsync.train"]``
        or ``["script.py", "--flag"]``.
        """
        if not isinstance(procs_per_host, int) or procs_per_host < 1:
            raise UsageError(f"--procs-per-host must be an integer >= 1, got {procs_per_host!r}")
        return self.run(lambda h: self.torchrun_argv(h, procs_per_host, args), timeout, env,
                        echo)

