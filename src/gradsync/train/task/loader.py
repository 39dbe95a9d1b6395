"""Factories that take arguments (``--optimizer``, ``--scheduler``), by ``pkg.module:name``.

``gradsync.factory.load_factory`` loads model and data factories and insists
they take no arguments; an optimizer factory takes the parameter groups and the
learning rate, a scheduler factory the optimizer and the number of steps, so
they are loaded here, by the same import rules, and their signatures are
checked where they are used (``optim.py``).

A factory given from Python (``gs.train(optimizer=fn)``) is recorded in the
config by its ``module:qualname`` (what checkpoints compare) and travels to the
workers as the object itself, pickled like ``model=``/``data=``: :func:`given`
makes it what that name loads in this process, so a function of the caller's
own script works although its module (``__main__``) cannot be imported by name.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from collections.abc import Callable

from ...errors import UsageError
from ...factory import factory_name

_GIVEN: dict[str, Callable] = {}


def given(factories: dict[str, Callable]) -> None:
    """Make ``name -> factory`` what :func:`load_callable` returns for that name here."""
    _GIVEN.clear()
    _GIVEN.update(factories)


def load_callable(spec: str, flag: str) -> Callable:
    """Import ``pkg.module:name`` (``module:Class.method`` too) as ``python -m`` would."""
    if spec in _GIVEN:
        return _GIVEN[spec]
    mod_name, _, attr = str(spec).partition(":")
    if not mod_name or not attr:
        raise UsageError(f"{flag} expects pkg.module:factory, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or anything the module raises on import
        raise UsageError(f"{flag} {spec}: cannot import {mod_name!r}: "
                         f"{type(e).__name__}: {e}") from None
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if fn is None or not callable(fn):
        raise UsageError(f"{flag} {spec}: {mod_name!r} has no callable {attr!r}")
    return fn


def take_factories(overrides: dict) -> dict[str, Callable]:
    """``optimizer=``/``scheduler=`` given to ``gs.train`` as functions: each becomes its
    ``module:qualname`` in ``overrides`` (the config's record) and an entry of the
    returned {name: function}, which travels to the workers pickled (:func:`given`)."""
    factories = {}
    for key in ("optimizer", "scheduler"):
        fn = overrides.get(key)
        if fn is None or isinstance(fn, str):
            continue
        qualname = getattr(fn, "__qualname__", "")
        if not callable(fn) or not qualname or "<lambda>" in qualname or "<locals>" in qualname:
            raise UsageError(f"{key}= takes a module-level function or 'pkg.module:factory' "
                             f"(a lambda, a nested function or an instance cannot reach the "
                             f"workers), got {fn!r}")
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise UsageError(f"{key}= {qualname} cannot reach the workers ({e})") from None
        name = factory_name(fn)
        overrides[key], factories[name] = name, fn
    return factories
