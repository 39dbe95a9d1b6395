"""Builds a netlab, starts a long sleep inside host 0, prints the namespace names, waits.

The tests kill this process (SIGKILL, SIGTERM) and check that nothing is left.
"""

import sys
import time

from gradsync.netlab import Netlab

try:
    with Netlab(int(sys.argv[1]), "1gbit") as lab:
        lab.popen(0, ["sleep", "300"])
        print(" ".join(lab.namespaces), flush=True)
        time.sleep(300)
finally:
    print("down", flush=True)
