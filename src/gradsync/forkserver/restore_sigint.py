"""Last forkserver preload: give SIGINT Python's default handler again, and make the
forkserver's own exit quick.

The forkserver records the handler in place after its preload as the one its
workers restore, so workers raise KeyboardInterrupt on Ctrl-C as any Python
process does (the first preload gave it a quiet exit for the preload).

When its launcher goes away the forkserver leaves through the interpreter's
normal shutdown, and with torch and torch._dynamo loaded that ran torch's
library finalizers for about 2 s (seen with py-spy: ``torch/library.py``'s
``_del_library``), while the forkserver still held the launcher's stdout and
stderr: a caller reading the command's output until the end (a pipe, a test, the
one-machine form of ``--ft-groups`` relaying its groups) waited those seconds after
the command had finished. The forkserver has nothing to clean up (its workers
exit by ``os._exit`` in any case, its socket lives in its launcher's temporary
directory), so the last exit handler to be registered, which runs first, ends
it at once after flushing its output.
"""

import atexit
import os
import signal
import sys

signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


atexit.register(_exit_now)
