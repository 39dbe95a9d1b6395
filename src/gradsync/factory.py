"""``module:factory`` specs: how every command names a user's own model, data, optimizer, schedule.

The one loader of a user's factories. ``gradsync plan memory MODEL``, ``gradsync
calibrate --model``, ``gradsync verify --model/--data``, ``gradsync export --model``
and ``gradsync train --model/--data/--optimizer/--scheduler`` all take
``pkg.module:factory``:
the module is imported as ``python -m`` would (the current directory is importable)
and ``factory`` is a callable in it. A file path works too, ``path/to/mycnn.py:build``
(what people type first): the file's directory goes on ``sys.path`` and the file is
imported under its own name, so everything it defines has an importable name (the
workers import it the same way; a relative path is read from the current directory,
which the workers share). ``No module named`` says where Python looked and how to
make it look further -- the same words whichever flag named it. What a factory is
called with is checked against its signature when it is loaded (a model factory takes
nothing, an optimizer factory the parameter groups and the learning rate). Kept
outside ``plan/`` and ``train/`` so either may use it without importing the other, and
free of torch so the planner stays pure.
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


def is_file_spec(mod_name: str) -> bool:
    """``./mycnn.py``, ``models/cnn.py``: a path rather than a dotted module name."""
    return mod_name.endswith(".py") or "/" in mod_name or os.sep in mod_name


def absolute_spec(text: str) -> str:
    """``path/to/file.py:factory`` with the path made absolute (``pkg.module:factory``, a
    built-in name and an absolute path unchanged): what a run records, so that ``gradsync
    export`` and a resume from another directory find the file a relative path named from
    the directory the run was started in (issue 37)."""
    mod, sep, attr = str(text).partition(":")
    if sep and mod and attr and is_file_spec(mod) and not os.path.isabs(mod):
        return f"{os.path.abspath(mod)}:{attr}"
    return text


def _import_file(path: str):
    """Import ``path`` under its file name, its directory first on ``sys.path``."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise UsageError(f"cannot import {path!r}: no such file (from {os.getcwd()})")
    folder, name = os.path.split(full)
    name = name[:-3] if name.endswith(".py") else name
    if not name.isidentifier():
        raise UsageError(f"cannot import {path!r}: {name!r} is not a Python module name; "
                         "rename the file (letters, digits, underscores)")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = _import(name, path)
    where = os.path.abspath(getattr(module, "__file__", "") or "")
    if where != full:
        raise UsageError(f"cannot import {path!r}: the name {name!r} is already taken by "
                         f"{where or 'a built-in module'}; rename the file")
    return module


def _import(mod_name: str, shown: str):
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        top = mod_name.partition(".")[0]
        if e.name and (e.name == mod_name or mod_name.startswith(e.name + ".") or e.name == top):
            hint = (f"; run from the directory that holds {top}.py (or the {top}/ package), "
                    f"or add that directory to PYTHONPATH, or pass the file: "
                    f"path/to/{mod_name.replace('.', '/')}.py:factory"
                    if not is_file_spec(shown) else "")
            raise UsageError(f"cannot import {shown!r}: no module named {e.name!r} on the "
                             f"path (from {os.getcwd()}){hint}") from None
        raise UsageError(f"cannot import {shown!r}: it imports {e.name!r}, which is neither "
                         f"installed nor on the path (from {os.getcwd()})") from None
    except Exception as e:  # ImportError, or anything the module raises on import
        relative = "relative import" in str(e)
        hint = ("; it uses relative imports, so import it as part of its package: "
                "pkg.module:factory from the package's parent directory") if relative else ""
        raise UsageError(f"cannot import {shown!r}: {type(e).__name__}: {e}{hint}") from None


def load_factory(text: str, flag: str | None = None, args: tuple[str, ...] = ()):
    """Import ``module:factory`` or ``path/to/file.py:factory`` (the user's own modules
    too, like ``python -m``) and check it can be called with ``args``.

    ``args``: the names of what it is called with -- none for a model or data factory,
    ``("param_groups", "lr")`` for ``--optimizer``, ``("optimizer", "total_steps")`` for
    ``--scheduler``. ``flag``: the flag that named it, which every error then starts with
    (``--optimizer ./f.py:make: cannot import ...``); the hints are the same for every
    kind of factory.
    """
    try:
        mod_name, _, attr = str(text).partition(":")
        if not mod_name or not attr:
            raise UsageError(f"expected module:factory, got {text!r}")
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = (_import_file(mod_name) if is_file_spec(mod_name)
                  else _import(mod_name, mod_name))
        factory = module
        for part in attr.split("."):  # module:Class.method works too
            factory = getattr(factory, part, None)
        if factory is None or not callable(factory):
            raise UsageError(f"{mod_name!r} has no callable {attr!r}")
        _check_arguments(factory, text if flag is None else f"{flag} {text}", args)
    except UsageError as e:
        if flag is None or str(e).startswith(flag):
            raise
        raise UsageError(f"{flag} {text}: {e}") from None
    return factory


def _check_arguments(fn, name: str, args: tuple[str, ...] = ()) -> None:
    """``fn`` can be called with ``args`` (positionally), or one line saying how it is called."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    called = f"{name.rpartition(':')[2]}({', '.join(args)})"
    if args:
        try:
            sig.bind(*args)
        except TypeError:
            count = {1: "one argument", 2: "two arguments"}.get(len(args), f"{len(args)} arguments")
            raise UsageError(f"{name} must take {count}, {' and '.join(args)} (it is called "
                             f"as {called})") from None
        return
    needed = [p.name for p in sig.parameters.values() if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed:
        raise UsageError(f"factory {name} must take no arguments (it is called as "
                         f"{called}), but it needs {', '.join(needed)}: "
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
    _check_arguments(fn, name)
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
