"""``module:factory`` specs: how every command names a user's own model or data.

``gradsync plan memory --model``, ``gradsync calibrate --model`` and ``gradsync
train --model/--data`` all take ``pkg.module:factory``: the module is imported as
``python -m`` would (the current directory is importable) and ``factory`` is a
callable in it. Kept outside ``plan/`` and ``train/`` so either may use it without
importing the other, and free of torch so the planner stays pure.
"""

from __future__ import annotations

import importlib
import os
import sys

from .errors import UsageError


def is_factory_spec(text: str) -> bool:
    """``pkg.module:factory`` (a colon with something on both sides)."""
    mod, sep, attr = str(text).partition(":")
    return bool(sep and mod and attr)


def load_factory(text: str):
    """Import ``module:factory`` (the user's own modules too, like ``python -m``)."""
    mod_name, _, attr = str(text).partition(":")
    if not mod_name or not attr:
        raise UsageError(f"expected module:factory, got {text!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or anything the module raises on import
        raise UsageError(f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    factory = module
    for part in attr.split("."):  # module:Class.method works too
        factory = getattr(factory, part, None)
    if factory is None or not callable(factory):
        raise UsageError(f"{mod_name!r} has no callable {attr!r}")
    return factory


def factory_name(fn) -> str:
    """``module:qualname`` of a callable: how a run records the factory it was given."""
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}:{getattr(fn, '__qualname__', type(fn).__name__)}"
