"""Small helpers shared by subcommand modules: JSON output and positive numbers."""

from __future__ import annotations

import dataclasses
import json

from ..errors import UsageError


def print_json(obj) -> None:
    print(json.dumps(dataclasses.asdict(obj), indent=1))


def positive(value, flag: str, allow_zero: bool = False):
    """Flags are parsed by argparse as numbers; their range is checked here (one line)."""
    if value is None:
        return None
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{flag} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value
