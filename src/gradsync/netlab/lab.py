"""Emulated hosts on one machine: network namespaces joined by rate-limited veth links.

What is emulated, and what is not (this kernel has no ``netem``):

* **Bandwidth and queueing** of each host's link, in both directions: a ``tbf``
  qdisc (token bucket: ``rate``, ``burst``, a queue of ``latency`` worth of bytes)
  on the egress of both ends of the host's veth. With two hosts the veth joins
  them directly; with more, each host's veth ends on a port of a bridge in a
  separate "switch" namespace, so a host's upload is limited on its side and its
  download on the bridge port -- the model of hosts on one switch, each with its
  own NIC-speed link (a parameter server's link is then the bottleneck it is on
  real networks).
* **Not propagation delay**: without netem there is no added latency, so alpha
  is this machine's (sub-millisecond) rather than a real network's.
* **Not separate CPUs**: every host's ranks share this machine's cores; the
  figures are about the link, not the compute.
* Ranks inside one host talk over the host's own loopback (a connection to one's
  own address is routed through ``lo``), which is not rate-limited.

Measured goodput through the ``tbf`` here (TCP, one stream, 10-20 MB): 95.5
Mbit/s at 100mbit, 383 at 400mbit, 955 at 1gbit, for any burst from 16 to 256
KiB. The default burst, 32 KiB, is small enough that messages above ~64 KB see
the rate (a large burst lets small messages pass at memory speed and bends the
alpha-beta fit) and large enough for 1 Gbit/s.

Addresses exist only inside the namespaces created here (``10.213.0.0/24``,
host i at ``.10 + i``, so torchrun's rendezvous, which orders nodes by address
string, gives host i group rank i); nothing is added to the machine's own
namespace. Names carry the creating process's pid and start time (cleanup.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..plan.units import parse_bytes, parse_rate
from . import cleanup

IFACE = "gs0"
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


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    iface: str
    addr: str


@dataclass(frozen=True)
class HostResult:
    host: int
    returncode: int | None  # None: killed (timeout, or a peer host failed first)
    stdout: str
    stderr: str
    timed_out: bool = False


def tc_rate(rate) -> tuple[float, str]:
    """'100mbit' (or bytes/s as a number) -> (bytes per second, tc's 'NNNbit')."""
    bps = parse_rate(rate, "--rate")
    return bps, f"{round(bps * 8)}bit"


class Netlab:
    """``hosts`` emulated hosts whose links run at ``rate`` each way.

    >>> with Netlab(hosts=2, rate="100mbit") as lab:          # doctest: +SKIP
    ...     results = lab.torchrun(["-m", "gradsync.train", "--model", "mlp"],
    ...                            procs_per_host=1, timeout=600)

    ``rate``: tc-style ('100mbit', '1gbit') or anything ``plan.units.parse_rate``
    reads. ``burst``/``latency``: the tbf's bucket and queue (see module doc).
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

    def _sh(self, *args: str) -> None:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise UsageError(f"netlab: '{' '.join(args)}' failed: {r.stderr.strip()}")

    def _limit(self, ns: str, dev: str) -> None:
        self._sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                 self._tc_rate, "burst", self._burst, "latency", self._latency)

    def _build(self) -> None:
        for ns in self.namespaces:
            self._sh("ip", "netns", "add", ns)
            self._sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.switch is None:  # two hosts: one veth, a rate limit on each end
            a, b = self.hosts
            self._sh("ip", "link", "add", IFACE, "netns", a.netns, "type", "veth",
                     "peer", "name", IFACE, "netns", b.netns)
        else:
            self._sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                port = f"p{h.index}"
                self._sh("ip", "link", "add", IFACE, "netns", h.netns, "type", "veth",
                         "peer", "name", port, "netns", self.switch)
                self._sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                self._sh("ip", "-n", self.switch, "link", "set", port, "up")
                self._limit(self.switch, port)  # the host's download
        for h in self.hosts:
            self._sh("ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", IFACE)
            self._sh("ip", "-n", h.netns, "link", "set", IFACE, "up")
            self._limit(h.netns, IFACE)  # the host's upload (both ends, with two hosts)

    def down(self) -> None:
        """Stop every process started here, remove the namespaces; idempotent."""
        if not self._up:
            return
        try:
            for p in self._procs:
                _terminate(p)
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
        procs, readers, outs = [], [], []
        for h, argv in zip(self.hosts, argvs):
            p = self.popen(h, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, errors="replace")
            out: tuple[list[str], list[str]] = ([], [])
            for stream, sink in ((p.stdout, out[0]), (p.stderr, out[1])):
                t = threading.Thread(target=_pump, args=(stream, sink, f"[h{h.index}] " if echo
                                                         else None), daemon=True)
                t.start()
                readers.append(t)
            procs.append(p)
            outs.append(out)
        deadline = time.monotonic() + timeout
        stop_at = deadline  # earlier once a host failed: its peers get grace_s
        killed = [False] * len(procs)
        timed_out = False
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > stop_at:
                timed_out = now > deadline
                break
            if any(p.poll() not in (None, 0) for p in procs):
                stop_at = min(stop_at, now + grace_s)
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if p.poll() is None:
                killed[i] = True
                _terminate(p)
        for ns in self.namespaces:  # workers a killed agent left behind
            if any(killed):
                cleanup.kill_inside(ns)
        for t in readers:
            t.join(timeout=5)
        for p in procs:
            if p in self._procs:
                self._procs.remove(p)
        return [HostResult(i, None if killed[i] else p.returncode, "".join(o[0]), "".join(o[1]),
                           timed_out and killed[i])
                for i, (p, o) in enumerate(zip(procs, outs))]

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


def _pump(stream, sink: list[str], prefix: str | None) -> None:
    for line in stream:
        sink.append(line)
        if prefix is not None:
            print(prefix + line, end="", flush=True)
    stream.close()


def _terminate(p: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process's session (torchrun forwards it to its workers), then SIGKILL."""
    if p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
