"""Last forkserver preload: give SIGINT Python's default handler again.

The forkserver records the handler in place after its preload as the one its
workers restore, so workers raise KeyboardInterrupt on Ctrl-C as any Python
process does (the launcher started the forkserver with SIGINT ignored).
"""

import signal

signal.signal(signal.SIGINT, signal.default_int_handler)
