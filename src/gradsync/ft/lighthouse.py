"""The lighthouse's settings, derived from the run, and a lighthouse started with them.

torchft's lighthouse forms each quorum (torchft 0.2.0, ``src/lighthouse.rs``,
``quorum_compute``, run on every request and every ``quorum_tick_ms``):

1. *fast quorum*: once every member of the previous quorum has asked, the quorum
   is issued at once, with every group waiting at that moment;
2. otherwise it needs ``min_replicas`` waiting groups, more than half of the
   groups heartbeating, and then either every heartbeating group waiting, or
   ``join_timeout_ms`` elapsed since the *earliest* waiting request;
3. a group that asked and was left out waits on for the next quorum, its request
   re-dated to the moment it was left out.

So a join timeout shorter than a step turns one late group into a heal at every
step (issue 35): a group left out of step ``s`` has waited a whole step when the
others ask for ``s + 1``, the timeout has already run out, and the quorum forms
the moment a second group asks, leaving out the third, a few milliseconds behind.
Measured with 2 s steps and ``join_timeout_ms 1000``: 12 heals in 14 steps.

The settings (:func:`settings_for`), each with its reason (``docs/fault_tolerance.md``):

* ``min_replicas`` = a strict majority of the groups: two quorums can never train
  side by side (seen here with 1);
* ``join_timeout_ms`` = the run's ``--timeout``: a quorum waits for every group that
  heartbeats, however long its step. A dead group stops heartbeating and is dropped
  after ``heartbeat_timeout_ms``, so only a group that is alive and has not asked is
  waited for, and such a group is a healthy one a little behind (a heal, a slow
  step, a busy machine). gradsync asks again every ``replica.QUORUM_TRY_S``, which
  re-dates the request, so in practice the clock never reaches the timeout; it is
  the backstop, the bound every other wait of the run has too;
* ``heartbeat_timeout_ms`` = 1000: ten of torchft's 100 ms heartbeats; the longest
  gap between a live group's heartbeats measured here was 0.10 s at load 12 on 2
  cores, and it is the survivors' pause after a group dies;
* ``quorum_tick_ms`` = 50: how soon a dead group's expiry is noticed between
  requests (a tick costs a lock and a scan of a few entries).
"""

from __future__ import annotations

from dataclasses import dataclass

from .requirement import torchft

HEARTBEAT_MS = 1000
TICK_MS = 50
DEFAULT_PORT = 29510  # torchft_lighthouse's own default


def default_min_groups(groups: int) -> int:
    """The smallest quorum that cannot coexist with another: a strict majority."""
    return groups // 2 + 1


@dataclass(frozen=True)
class LighthouseSettings:
    """torchft_lighthouse's options for a job of ``groups`` groups (module docstring)."""

    min_replicas: int
    join_timeout_ms: int
    heartbeat_timeout_ms: int = HEARTBEAT_MS
    quorum_tick_ms: int = TICK_MS

    def argv(self, bind: str) -> list[str]:
        """The ``torchft_lighthouse`` options, for the cluster form's own lighthouse."""
        return ["--min_replicas", str(self.min_replicas), "--join_timeout_ms",
                str(self.join_timeout_ms), "--heartbeat_timeout_ms",
                str(self.heartbeat_timeout_ms), "--quorum_tick_ms", str(self.quorum_tick_ms),
                "--bind", bind]

    def reasons(self) -> list[str]:
        """One line per setting: its value and why (printed by ``gradsync lighthouse``)."""
        return [f"--min_replicas {self.min_replicas}: a strict majority of the groups, so two "
                "quorums can never train side by side",
                f"--join_timeout_ms {self.join_timeout_ms}: the run's --timeout; a quorum waits "
                "for every group that heartbeats, however long its step",
                f"--heartbeat_timeout_ms {self.heartbeat_timeout_ms}: ten missed heartbeats; a "
                "dead group is dropped after this, the survivors' pause",
                f"--quorum_tick_ms {self.quorum_tick_ms}: how soon a dead group's expiry is "
                "noticed between requests"]


def settings_for(groups: int, timeout_s: float) -> LighthouseSettings:
    """The lighthouse's settings for ``groups`` groups and the run's ``--timeout``."""
    return LighthouseSettings(min_replicas=default_min_groups(groups),
                              join_timeout_ms=int(max(timeout_s, 1.0) * 1000))


@dataclass
class Lighthouse:
    """A running lighthouse; ``address`` is what ``--ft-lighthouse`` takes."""

    server: object
    address: str
    settings: LighthouseSettings

    @property
    def min_groups(self) -> int:
        return self.settings.min_replicas

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(settings: LighthouseSettings, host: str = "127.0.0.1",
                     port: int = 0) -> Lighthouse:
    """torchft's lighthouse in this process (the one-machine form, ``gradsync lighthouse``)."""
    tf = torchft()
    server = tf._torchft.LighthouseServer(bind=f"{host}:{port}",
                                          min_replicas=settings.min_replicas,
                                          join_timeout_ms=settings.join_timeout_ms,
                                          quorum_tick_ms=settings.quorum_tick_ms,
                                          heartbeat_timeout_ms=settings.heartbeat_timeout_ms)
    bound_port = server.address().rsplit(":", 1)[1]  # torchft names the machine's hostname
    shown = "127.0.0.1" if host in ("0.0.0.0", "[::]", "::") else host
    return Lighthouse(server, f"http://{shown}:{bound_port}", settings)
