"""A run's flags in a TOML file: ``gradsync train --config run.toml``, and ``--print-config``.

A config file is the command line written down, so its rules are the command line's:

* **Keys are the flags**, without the dashes: ``global-batch = 64``, ``keep-best =
  "eval_loss"``. ``TrainConfig``'s field names (``global_batch``) are accepted too, so
  one file serves ``gradsync train --config`` and ``gs.train(config="run.toml")``. Flat:
  one key per flag, no tables (the flags have no sections either).
* **Values are TOML's types**: whole numbers, numbers, strings, ``true``/``false``; a
  whole number where a number is wanted is one. A flag without a value on the command
  line (``--trace``) is ``trace = true``. A flag with a default of "not given"
  (``--clip``, ``--weight-decay``) is left out of the file to mean that.
* **The command line wins**: a flag typed after ``--config`` replaces the file's value,
  a flag left out takes the file's, and a flag in neither its default. Which flags were
  typed is read from the command line itself (:func:`given_flags`), so a flag typed with
  its default value still wins over the file.
* **Paths are the command line's**: relative to the current directory, as if typed.
* **Checked as the flags are**, before anything starts, each problem one line naming the
  file and the key: a file that is missing, not a regular file, larger than 1 MiB, not
  UTF-8 or not TOML (with its line and column); an unknown key (with the nearest flag); a
  value of the wrong type or not among the flag's choices. Reading a file runs no code
  (TOML is data), and the flags' own checks (``resolve.py``) follow as for typed ones.
* **Python**: ``tomllib`` from 3.11; on 3.10 the ``tomli`` package, which is the same
  parser (a dependency there, ``pyproject.toml``), and without it one line saying so.

``--print-config`` writes the resolved configuration -- every flag, the defaults
resolving filled in (``--data``, ``--out``, ``--clip``) included -- as such a file, in
the flag table's order: ``gradsync train --config`` of it is the same run (the same
``RunConfig``; ``tests/train/test_config_file.py``). It prints and exits; nothing starts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import stat
from dataclasses import Field

from ...errors import UsageError

MAX_BYTES = 1 << 20
"""A run's flags fit in a few KiB; a larger --config is refused before it is parsed."""
NOT_FLAGS = ("config", "print_config")


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError("--config needs a TOML reader: Python 3.11 or later has one "
                             "(tomllib); on 3.10, pip install tomli") from None
    return tomllib


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _read(path: str) -> dict:
    where = f"--config {path}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file; give the path of a TOML file of "
                         "gradsync train's flags (gradsync train --print-config writes one)") \
            from None
    except OSError as e:
        raise UsageError(f"{where}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{where} is not a regular file; give a TOML file")
    if st.st_size > MAX_BYTES:
        raise UsageError(f"{where} is {st.st_size:,} bytes; a file of flags is a few KiB (at "
                         f"most {MAX_BYTES:,}): is it the right file?")
    tomllib = _toml()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        text = raw.decode("utf-8")
        return tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise UsageError(f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start}): give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where} is not valid TOML ({e}); fix that line") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot be read ({e.strerror or e})") from None


def _kind(f: Field) -> str:
    return str(f.type).replace(" ", "")


_WANTS = {"int": "a whole number", "float": "a number", "float|None": "a number",
          "str": "a string", "bool": "true or false", "float|str": "a number or \"auto\""}


def _value(path: str, key: str, f: Field, value):
    """``value`` checked against the field's type and choices (and its flag's own parser)."""
    kind = _kind(f)
    bad = {"int": lambda v: not isinstance(v, int) or isinstance(v, bool),
           "float": lambda v: not isinstance(v, (int, float)) or isinstance(v, bool),
           "float|None": lambda v: not isinstance(v, (int, float)) or isinstance(v, bool),
           "str": lambda v: not isinstance(v, str),
           "bool": lambda v: not isinstance(v, bool),
           "float|str": lambda v: isinstance(v, bool) or not isinstance(v, (int, float, str)),
           }.get(kind, lambda v: False)
    flag = _flag(f.name)
    if bad(value):
        raise UsageError(f"--config {path}: {key} = {_shown(value)}: {flag} takes "
                         f"{_WANTS.get(kind, kind)}; fix the file, or give {flag} on the command "
                         "line")
    if kind in ("float", "float|None") or (kind == "float|str" and not isinstance(value, str)):
        value = float(value)
    convert = f.metadata.get("type")
    if isinstance(value, str) and convert is not None:
        try:
            value = convert(value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise UsageError(f"--config {path}: {key} = {_shown(value)}: {e}") from None
    choices = f.metadata.get("choices")
    choices = choices() if callable(choices) else choices
    if choices and value not in choices:
        raise UsageError(f"--config {path}: {key} = {_shown(value)}: {flag} takes one of "
                         f"{', '.join(map(str, choices))}")
    return value


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    if isinstance(value, bool):
        text = str(value).lower()
    return text if len(text) <= 40 else text[:37] + "..."


def read_toml(path: str, fields: list[Field]) -> dict:
    """The file's flags as {field name: value}, every key and value checked (one line)."""
    path = os.fspath(path)
    data = _read(path)
    by_name = {f.name: f for f in fields}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in NOT_FLAGS:
            raise UsageError(f"--config {path}: {key} is an option of the command itself, not "
                             "of the run; leave it out of the file")
        f = by_name.get(name)
        if f is None:
            keys = sorted({n.replace("_", "-") for n in by_name})
            near = difflib.get_close_matches(key.replace("_", "-"), keys, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UsageError(f"--config {path}: unknown key {key!r}{hint}; the keys are "
                             "gradsync train's flags without the dashes (gradsync train --help)")
        if isinstance(value, dict):
            raise UsageError(f"--config {path}: [{key}] is a table; the file is flat, one key "
                             f"per flag ({key} = ...)")
        if name in out:
            raise UsageError(f"--config {path}: {key} is given twice (as {name} and "
                             f"{name.replace('_', '-')}); keep one")
        out[name] = _value(path, key, f, value)
    return out


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return json.dumps(str(value))  # JSON's escapes are TOML basic-string escapes


def to_toml(values: dict, fields: list[Field], command: str = "gradsync train") -> str:
    """``values`` (a resolved config's flags, ``RunConfig.to_dict``) as a config file."""
    helps = {f.name: f.metadata.get("help", "") for f in fields}
    lines = [f"# {command} --config FILE: this run's resolved flags (flags typed on the "
             "command line win)"]
    for name, value in values.items():
        if value is None or name not in helps:  # "not given" (--clip, --weight-decay)
            continue
        lines.append(f"{name.replace('_', '-')} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
