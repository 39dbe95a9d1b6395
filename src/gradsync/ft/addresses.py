"""The names other groups use to reach this one must resolve, and not to loopback, on a cluster.

torchft tells the other groups how to reach this group by *names* it picks here:

* the manager server (quorum and commit calls) and every rank's checkpoint server
  (a healing peer fetches the state from it) by ``socket.gethostname()``;
* the store of this group's process-group rendezvous (every group of a quorum
  connects to the first group's store) by the address gradsync gives the Manager,
  ``MASTER_ADDR`` (torchrun sets it to the address of the node holding its store).

On one machine every name leads to the same place. On a cluster a hostname that
resolves to ``127.0.1.1`` (Debian's ``/etc/hosts`` default) or a ``MASTER_ADDR`` of
``localhost`` leads each group back to itself: a heal fetches its own state, the
rendezvous waits for peers that connect elsewhere, and the job fails minutes later
with a timeout that names neither. So before starting its Manager each rank checks,
when the lighthouse is on another host (its address does not resolve to loopback),
that both names resolve here to an address that is not loopback, and says in one
line which one does not and how to fix it. What this cannot check from here: that
the *other* hosts resolve the name to the same address (the docs say so).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from ..errors import UsageError


def resolve(name: str) -> list[str]:
    """Every address ``name`` resolves to here ([] when it does not resolve)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
    except (OSError, UnicodeError):
        return []


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_addresses(lighthouse: str, store_host: str, hostname: str | None = None) -> None:
    """Refuse, in one line, names that would lead other groups back to themselves (module
    docstring); nothing to check when the lighthouse is on this machine."""
    host = urlsplit(lighthouse).hostname or ""
    found = resolve(host)
    if not found:
        raise UsageError(f"--ft-lighthouse {lighthouse}: the host {host!r} does not resolve "
                         "here; give an address or a name every group's host resolves")
    if all(is_loopback(a) for a in found):
        return  # the one-machine form: every name leads here, as it should
    hostname = hostname or socket.gethostname()
    for what, name, fix in (
            ("this host's name", hostname,
             "torchft gives it to the other groups to reach this group's manager and "
             "checkpoint server; make it resolve to this host's address on every host "
             "(DNS or /etc/hosts)"),
            ("MASTER_ADDR", store_host,
             "the other groups connect to this group's store by it; launch with torchrun "
             "--rdzv-endpoint HOST:PORT on an address the other hosts reach (or "
             "--local-addr)")):
        addrs = resolve(name)
        if not addrs:
            raise UsageError(f"{what} {name!r} does not resolve here, and the lighthouse is on "
                             f"another host ({host}): {fix}")
        if all(is_loopback(a) for a in addrs):
            raise UsageError(f"{what} {name!r} resolves to {', '.join(addrs)} (loopback), and "
                             f"the lighthouse is on another host ({host}): the other groups "
                             f"would reach themselves; {fix}")
