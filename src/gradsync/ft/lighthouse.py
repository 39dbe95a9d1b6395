"""A lighthouse inside this process, for the one-machine form of fault-tolerant training.

On a cluster the lighthouse is torchft's own binary on a node of its own
(``torchft_lighthouse --min_replicas M``). On one machine ``gradsync train
--ft-groups N`` starts it here, beside the groups it launches.

Timing defaults, and why (``docs/fault_tolerance.md``): a dead group stops
heartbeating and the lighthouse drops it after ``heartbeat_ms`` (1 s: ten
missed heartbeats at torchft's 100 ms interval); ``join_ms`` is how long a quorum
waits for a heartbeating group that has not asked yet (1 s, which covers a slow
step's skew between groups without stretching the pause after a failure).
"""

from __future__ import annotations

from dataclasses import dataclass

from .requirement import torchft

HEARTBEAT_MS = 1000
JOIN_MS = 1000
TICK_MS = 50


@dataclass
class Lighthouse:
    """A running lighthouse; ``address`` is what ``--ft-lighthouse`` takes."""

    server: object
    address: str
    min_groups: int

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(min_groups: int, host: str = "127.0.0.1", port: int = 0,
                     heartbeat_ms: int = HEARTBEAT_MS, join_ms: int = JOIN_MS) -> Lighthouse:
    """Start a lighthouse that forms a quorum once ``min_groups`` groups ask."""
    tf = torchft()
    server = tf._torchft.LighthouseServer(bind=f"{host}:{port}", min_replicas=min_groups,
                                          join_timeout_ms=join_ms, quorum_tick_ms=TICK_MS,
                                          heartbeat_timeout_ms=heartbeat_ms)
    bound_port = server.address().rsplit(":", 1)[1]  # torchft names the machine's hostname
    return Lighthouse(server, f"http://{host}:{bound_port}", min_groups)
