"""``gradsync netlab``: a multi-host network emulated on one machine, to measure on.

Emulated hosts are Linux network namespaces joined by veth pairs (through a bridge
for more than two), each host's link rate-limited both ways with ``tc tbf``; one
``torchrun`` agent per host makes a real multi-node run. Needs root. See
``lab.py`` for what is and is not emulated, ``links.py`` for how, and
docs/netlab.md for measurements.

Importing this package imports no torch.
"""

from .cleanup import leftovers, list_namespaces
from .lab import Host, HostResult, Netlab, NetlabUnavailable, unavailable_reason

__all__ = ["Host", "HostResult", "Netlab", "NetlabUnavailable", "leftovers", "list_namespaces",
           "unavailable_reason"]
