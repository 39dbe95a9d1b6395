"""Running one command per emulated host at once, and stopping what runs there.

A multi-node job whose one host failed usually cannot finish (its peers wait in a
collective for a rank that is gone), so after a failure the others get a grace
period and are then stopped; output is read on threads so a full pipe never
stalls a host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import cleanup
from .links import Host


@dataclass(frozen=True)
class HostResult:
    host: int
    returncode: int | None  # None: killed (timeout, or a peer host failed first)
    stdout: str
    stderr: str
    timed_out: bool = False


def run_all(popen: Callable[..., subprocess.Popen], hosts: tuple[Host, ...], argvs: list,
            namespaces: list[str], timeout: float, env: dict | None, echo: bool,
            grace_s: float) -> tuple[list[HostResult], list[subprocess.Popen]]:
    """``argvs[i]`` on ``hosts[i]`` through ``popen`` (a Netlab's); wait for all, at most
    ``timeout`` seconds, the others ``grace_s`` more once one failed. Returns the results
    and the processes (all ended), which the caller no longer needs to track."""
    procs, readers, outs = [], [], []
    for h, argv in zip(hosts, argvs):
        p = popen(h, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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
            terminate(p)
    for ns in namespaces:  # workers a killed agent left behind
        if any(killed):
            cleanup.kill_inside(ns)
    for t in readers:
        t.join(timeout=5)
    return [HostResult(i, None if killed[i] else p.returncode, "".join(o[0]), "".join(o[1]),
                       timed_out and killed[i])
            for i, (p, o) in enumerate(zip(procs, outs))], procs


def _pump(stream, sink: list[str], prefix: str | None) -> None:
    for line in stream:
        sink.append(line)
        if prefix is not None:
            print(prefix + line, end="", flush=True)
    stream.close()


def terminate(p: subprocess.Popen, grace_s: float = 3.0) -> None:
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
