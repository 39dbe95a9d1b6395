"""What torchft's lighthouse knows, read from its own status page: who heartbeats, the last quorum.

torchft 0.2.0's lighthouse serves ``GET /status`` on its quorum port (the page its
dashboard shows): the current quorum id, the previous quorum's members with their
steps, and every replica it has heard from with the age of its last heartbeat,
marked ``old`` past its ``--heartbeat_timeout_ms``. It is the only read-only view
of the lighthouse's state; torchft's clients (``LighthouseClient.quorum``,
``heartbeat``) would make the reader a member of the next quorum.

gradsync reads it for two decisions no quorum request can make without changing
the quorum:

* **the start barrier** (``replica.py``): a fresh job's groups ask for their first
  quorum only once every group heartbeats, so the first quorum holds them all; a
  group that finds a quorum already formed is a replacement in a running job and
  does not wait;
* **the job's end** (``closing.py``): a group that comes back after the job ended
  sees that the last quorum was at the last step and that none of its members
  heartbeats any more, and says so instead of waiting out its quorum timeout.

The page is HTML rendered from the pinned version's template; :func:`parse` reads
exactly its lines (tested against the real lighthouse in ``tests/ft``). A page
that cannot be read gives ``None``, and the callers fall back to waiting as
before, never to a wrong decision.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

GROUP_ID_PREFIX = "gradsync_group_"  # torchft reads the trailing digits as the group's index
_QUORUM_ID = re.compile(r"Current quorum_id:\s*(-?\d+)")
_STATUS = re.compile(r"Next quorum status:\s*(.*)")
_MEMBER = re.compile(r"<b>\s*(\S+?)\s*</b>\s*<br/>\s*Step:\s*(-?\d+)")
_BEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+): seen ([0-9.eE+-]+)s ago')


@dataclass(frozen=True)
class Beat:
    """One replica's last heartbeat: its age, and whether the lighthouse counts it dead."""

    age_s: float
    old: bool


@dataclass
class LighthouseStatus:
    """The lighthouse's state as its status page shows it."""

    quorum_id: int
    next_status: str
    members: dict[str, int] = field(default_factory=dict)  # last quorum: replica id -> step
    beats: dict[str, Beat] = field(default_factory=dict)

    def alive_groups(self) -> set[int]:
        """Indices of the gradsync groups with a replica the lighthouse counts as alive."""
        return {g for rid, b in self.beats.items() if not b.old
                for g in [group_of(rid)] if g is not None}

    def member_groups(self) -> dict[int, int]:
        """The last quorum's gradsync groups and their steps."""
        return {g: s for rid, s in self.members.items() for g in [group_of(rid)] if g is not None}

    def members_alive(self) -> bool:
        """Whether any member of the last quorum (that very replica) still heartbeats."""
        return any(rid in self.beats and not self.beats[rid].old for rid in self.members)


def group_of(replica_id: str) -> int | None:
    """The gradsync group of a torchft replica id (``gradsync_group_G:UUID``), else None."""
    name = replica_id.split(":", 1)[0]
    if name.startswith(GROUP_ID_PREFIX) and name[len(GROUP_ID_PREFIX):].isdigit():
        return int(name[len(GROUP_ID_PREFIX):])
    return None


def parse(page: str) -> LighthouseStatus | None:
    """The status page's content, or None when it is not the page this reader knows."""
    qid = _QUORUM_ID.search(page)
    if qid is None:
        return None
    status = _STATUS.search(page)
    members = {rid: int(step) for rid, step in _MEMBER.findall(page)}
    beats = {rid: Beat(float(age), bool(old)) for old, rid, age in _BEAT.findall(page)}
    return LighthouseStatus(int(qid.group(1)), status.group(1).strip() if status else "",
                            members, beats)


def fetch_page(address: str, timeout_s: float = 2.0) -> str | None:
    """The status page of the lighthouse at ``address`` (``http://HOST:PORT``), or None:
    unreachable."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout_s) as r:
            return r.read().decode("utf-8", errors="replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None


def read_status(address: str, timeout_s: float = 2.0) -> LighthouseStatus | None:
    """``address``'s status, or None: unreachable or unreadable."""
    page = fetch_page(address, timeout_s)
    return parse(page) if page is not None else None
