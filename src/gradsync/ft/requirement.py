"""torchft, imported only when a fault-tolerant run asks for it, with a one-line hint if absent."""

from __future__ import annotations

import importlib
import logging
import os
import warnings

from ..errors import UsageError

PIN = "torchft==0.2.0"  # the version gradsync is tested with (pyproject: the ft extra)
INSTALL = "pip install 'gradsync[ft]'"


VERBOSE_ENV = "GRADSYNC_FT_VERBOSE"  # 1: torchft's own logs (Rust INFO, Python tracebacks)


def torchft():
    """The ``torchft`` module, or a UsageError that says how to install it.

    torchft logs every quorum at INFO from Rust and a traceback for every peer
    failure it handles; gradsync says what happened in one line instead
    (``ft/quorum_step.py``), so both are quieted unless ``GRADSYNC_FT_VERBOSE=1``.
    """
    if os.environ.get(VERBOSE_ENV) != "1":
        os.environ.setdefault("RUST_LOG", "warn")  # read when the Rust extension loads
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
    try:
        return importlib.import_module("torchft")
    except ImportError as e:
        raise UsageError(f"fault-tolerant training (--ft-groups / --ft-group) needs torchft "
                         f"({PIN}), which is not installed here ({e}); install it with: "
                         f"{INSTALL}") from None
