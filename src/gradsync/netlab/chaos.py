"""Chaos on emulated hosts: worker kills, host kills and partitions at random moments.

Used by the fault-tolerance tests and ``benchmarks/fault_tolerance.py`` on a
:class:`~gradsync.netlab.groups.GroupsLab` (one replica group per host). A
:class:`Fault` is one of

* ``worker``: SIGKILL one worker of a group (its launcher restarts the group's
  workers, which heal from a live peer at the next quorum);
* ``host``: SIGKILL every process on a group's host at once (launcher, workers,
  torchft's servers), then, ``seconds`` later, start the group again on it, as a
  replacement machine would (it resumes its checkpoint and heals to the quorum);
* ``partition``: take a group's link down for ``seconds``, then up again (the
  processes live on, cut off: the others' collectives with it time out, the
  lighthouse stops hearing it, and once back it heals). A partition shorter than
  ``--ft-timeout`` (5 s) is only a pause: TCP retransmits, the step in flight
  completes once the link is back, nobody is dropped (measured: a 3 s partition
  made one step 3.3 s long); hence the default of 8 s.

A fault fires when the job has committed its step ``after_step`` (the most any
group has), its target is in step with the job (within ``IN_STEP`` steps) *and*
the target has committed a step since the previous fault fired: a fault hits a
training group, not one still restarting, and the job has answered the previous
fault (a new quorum) before the next, so faults do not all fire at one instant
when the job has run ahead of the schedule. Recoveries on different groups still
overlap, as they do on a real cluster. Or, for the
benchmark's failure rates, at ``at_s`` seconds after the start. :func:`plan`
draws a seeded schedule; :func:`unleash` carries it out and returns what
happened and when.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from ..errors import UsageError

KINDS = ("worker", "host", "partition")
IN_STEP = 2  # a target this many steps behind the job is still catching up: wait for it


@dataclass(frozen=True)
class Fault:
    kind: str
    group: int
    after_step: int | None = None
    at_s: float | None = None
    seconds: float = 0.0  # partition: how long the link is down; host: until the new one


@dataclass
class Fired:
    """One fault as it happened: when (seconds since the start), at which job step."""

    fault: Fault
    t_s: float
    job_step: int
    done: bool = True
    note: str = ""
    unix: float = 0.0  # when it fired (time.time()), to match the groups' metrics

    def window(self) -> tuple[int, float, float]:
        """(group, unix time, seconds its link stays down) for ``ft.membership``."""
        return (self.fault.group, self.unix,
                self.fault.seconds if self.fault.kind == "partition" else 0.0)


def plan(seed: int, groups: int, first_step: int, last_step: int, *, workers: int = 0,
         hosts: int = 0, partitions: int = 0, partition_s: float = 8.0,
         host_gap_s: float = 1.0) -> list[Fault]:
    """A seeded schedule: ``workers`` worker kills, ``hosts`` host kills and ``partitions``
    partitions at distinct random steps in ``first_step..last_step``, on random groups
    (never the same group twice in a row, so consecutive faults overlap)."""
    n = workers + hosts + partitions
    if last_step - first_step + 1 < n:
        raise UsageError(f"chaos: {n} faults need {n} steps, {first_step}..{last_step} "
                         "has fewer")
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(first_step, last_step + 1), n))
    kinds = ["worker"] * workers + ["host"] * hosts + ["partition"] * partitions
    rng.shuffle(kinds)
    out, last = [], None
    for step, kind in zip(steps, kinds):
        group = rng.choice([g for g in range(groups) if g != last] or [0])
        last = group
        seconds = partition_s if kind == "partition" else host_gap_s if kind == "host" else 0.0
        out.append(Fault(kind, group, after_step=step, seconds=seconds))
    return out


def at_rate(seed: int, groups: int, per_minute: float, duration_s: float,
            start_s: float = 10.0, kind: str = "worker") -> list[Fault]:
    """Faults of ``kind`` at ``per_minute`` a minute (evenly spaced from ``start_s``, on
    random groups): the benchmark's failure rates."""
    if per_minute <= 0:
        return []
    rng = random.Random(seed)
    gap = 60.0 / per_minute
    times = [start_s + k * gap for k in range(int((duration_s - start_s) / gap) + 1)
             if start_s + k * gap < duration_s]
    return [Fault(kind, rng.randrange(groups), at_s=t, seconds=1.0 if kind == "host" else 0.0)
            for t in times]


def unleash(lab, faults: list[Fault], stop: threading.Event | None = None,
            poll_s: float = 0.05) -> list[Fired]:
    """Carry out ``faults`` on ``lab`` (a GroupsLab) in order; returns what fired.

    Returns early (the rest not fired) once ``stop`` is set or every group's
    process has exited. Partitions heal and replaced hosts restart on timers, so a
    fault's recovery overlaps the next fault.
    """
    stop = stop or threading.Event()
    t0 = time.monotonic()
    fired: list[Fired] = []
    timers: list[threading.Timer] = []
    try:
        mark: dict[int, int] = {}  # each group's last committed step at the last fault
        for f in faults:
            while not stop.is_set() and _running(lab):
                if _due(lab, f, time.monotonic() - t0) and (
                        f.at_s is not None or lab.last_committed(f.group) > mark.get(f.group, -1)):
                    break
                time.sleep(poll_s)
            if stop.is_set() or not _running(lab):
                break
            job = _job_step(lab)
            mark = {g: lab.last_committed(g) for g in range(lab.groups)}
            fired.append(Fired(f, round(time.monotonic() - t0, 3), job, unix=time.time()))
            fired[-1].done, fired[-1].note = _fire(lab, f, timers)
    finally:
        for t in timers:  # a link still down, a host still to replace: do it now
            if t.is_alive():
                t.cancel()
                t.function(*t.args)
    return fired


def _running(lab) -> bool:
    return any(p.poll() is None for p in lab.procs.values())


def _job_step(lab) -> int:
    return max(lab.last_committed(g) for g in range(lab.groups))


def _due(lab, f: Fault, elapsed_s: float) -> bool:
    if f.at_s is not None:
        return elapsed_s >= f.at_s
    job = _job_step(lab)
    return job >= (f.after_step or 0) and lab.last_committed(f.group) >= job - IN_STEP


def _fire(lab, f: Fault, timers: list) -> tuple[bool, str]:
    if f.kind == "worker":
        pid = None
        for _ in range(100):  # between a restart and its workers' start: none to kill yet
            pid = lab.kill_worker(f.group, pick=random.randrange(1 << 16))
            if pid is not None:
                break
            time.sleep(0.05)
        return pid is not None, f"pid {pid}" if pid else "no worker was running"
    if f.kind == "host":
        lab.kill_host(f.group)
        timers.append(_later(f.seconds, lab.replace, f.group))
        return True, f"replaced after {f.seconds:g} s"
    if f.kind == "partition":
        lab.link(f.group, up=False)
        timers.append(_later(f.seconds, lab.link, f.group, True))
        return True, f"link down {f.seconds:g} s"
    raise UsageError(f"chaos: unknown fault kind {f.kind!r} (one of {', '.join(KINDS)})")


def _later(seconds: float, fn, *args) -> threading.Timer:
    t = threading.Timer(seconds, fn, args)
    t.daemon = True
    t.start()
    return t
