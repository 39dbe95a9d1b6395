"""``module:factory`` specs: how every command names a user's own model or data.

``gradsync plan memory MODEL``, ``gradsync calibrate --model`` and ``gradsync
train --model/--data`` all take ``pkg.module:factory``: the module is imported as
``python -m`` would (the current directory is importable) and ``factory`` is a
callable in it. Kept outside ``plan/`` and ``train/`` so either may use it without
importing the other, and free of torch so the planner stays pure.
"""

from __future__ import annotations

import importlib
import inspect
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
    _takes_no_arguments(factory, text)
    return factory


def _takes_no_arguments(fn, name: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    needed = [p.name for p in sig.parameters.values() if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed:
        raise UsageError(f"factory {name} must take no arguments (it is called as "
                         f"{name.rpartition(':')[2]}()), but it needs {', '.join(needed)}: "
                         "give them defaults, or wrap it in a function that supplies them")


def check_factory(fn, what: str) -> None:
    """A factory passed from Python (``gs.train(model=fn)``) that the workers can use.

    Each worker calls it, so it travels to them by name: a module-level function of
    an importable module. Refused here, in one line, before any worker starts: an
    instance instead of a factory, arguments it needs, a lambda or nested function,
    a function of a ``__main__`` that has no file (``python -c``, a notebook).
    """
    name = factory_name(fn)
    instance = hasattr(fn, "forward") and hasattr(fn, "parameters")  # an nn.Module
    if not callable(fn) or instance:
        raise UsageError(f"{what}= takes a factory, a function returning the "
                         f"{'model' if what == 'model' else 'dataset'} (each worker builds "
                         f"its own), not a {type(fn).__name__} instance")
    _takes_no_arguments(fn, name)
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise UsageError(f"{what} factory {name} cannot reach the workers: define it at "
                         "module level (a lambda or a nested function has no importable name)")
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if getattr(fn, "__module__", None) == "__main__" and not (main_file
                                                             and os.path.isfile(main_file)):
        raise UsageError(f"{what} factory {name} is defined in an interactive __main__ "
                         "(python -c, stdin, a notebook) that workers cannot import: put it "
                         "in a module file and pass that")


def factory_name(fn) -> str:
    """``module:qualname`` of a callable: how a run records the factory it was given."""
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}:{getattr(fn, '__qualname__', type(fn).__name__)}"
