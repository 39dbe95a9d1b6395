"""Last forkserver preload: give SIGINT Python's default handler again.

The forkserver records the handler in place after its preload as the one its
workers restore, so workers raise KeyboardInterrupt on Ctrl-C as any Python
process does (the first preload gave it a quiet exit for the preload).
"""

import signal

signal.signal(signal.SIGINT, signal.default_int_handler)
