"""Run-directory files that a failure never leaves half-written and damage never crashes.

Writing. A whole file (config.json, summary.json, plan.json, drift.json, trace.json,
report.html, the PNGs) is written through gradsync's one atomic writer
(:mod:`gradsync.atomic`): a temporary file beside it, fsynced and renamed over the
old one, never through a symbolic link; a full disk or an I/O error mid-write leaves
the previous file as it was. ``metrics.jsonl`` is appended to, one whole line per
``write(2)``, opened with ``O_NOFOLLOW`` (a symbolic link planted in its place is
refused, not appended through); if the write fails, or writes only part of the line
(a disk that fills mid-line), the file is cut back to its size before the write,
so readers never meet a line that is half there. Every ``OSError`` becomes one
:class:`~gradsync.errors.StorageError` whose message leads with the cause ("no
space left on device") and names the file -- never a chain of tracebacks.

Reading. A torn line (an interrupted write of an older writer, a crash), a line
that is not UTF-8 or not JSON, or a record whose fields are not of their kinds (a
``problem`` check, :func:`gradsync.rundir.record_problem`: ``{"epoch": 1}``,
``{"step": "seven"}``) is dropped and counted, with a note saying which line and
why; a whole JSON file that cannot be decoded is reported as corrupt
(:func:`read_json_checked` says why), never raised. Torch-free, below
:mod:`gradsync.rundir` (which re-exports what its callers use).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .atomic import TMP_PREFIX, storage_error, write_bytes  # noqa: F401 - TMP_PREFIX re-exported


def clean(obj):
    """``obj`` with every non-finite float replaced by None (recursively)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def dumps(obj, indent: int | None = None) -> str:
    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def write_text(path: str, text: str, what: str) -> None:
    write_bytes(path, text.encode("utf-8"), what)


def write_json(path: str, obj, indent: int = 2, what: str | None = None) -> None:
    """Write ``obj`` as valid JSON (NaN -> null), atomically; StorageError names the file."""
    write_text(path, dumps(obj, indent=indent), what or os.path.basename(path))


def read_json_checked(path: str) -> tuple[object, str | None]:
    """(value, None); (None, None) if absent; (None, why) if present but not readable JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError as e:
        return None, f"corrupt (byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8)"
    except ValueError as e:
        return None, f"corrupt (not valid JSON: {e})"


def read_json(path: str):
    """The parsed file; None if absent; False if present but unreadable or corrupt."""
    value, why = read_json_checked(path)
    return False if why else value


@dataclass
class MetricsFile:
    """What ``metrics.jsonl`` holds: step records, event records (``"event"``: a restart)
    and a note for every line dropped."""

    exists: bool = False
    records: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ordered: list[dict] = field(default_factory=list)  # records and events, in file order


Problem = Callable[[dict], "str | None"]
"""What is wrong with a decoded record (None: nothing), for a note "line N: <that>"."""


def read_metrics_file(path: str, problem: Problem | None = None) -> MetricsFile:
    """Every whole, decodable line (of which ``problem`` finds nothing wrong); the others
    dropped with a note (never raises)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return MetricsFile()
    except OSError as e:
        return MetricsFile(True, dropped=[f"the file is unreadable ({e.strerror or e})"])
    out = MetricsFile(True)
    lines = raw.split(b"\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if i == len(lines):  # no newline after it: a write that did not finish
            out.dropped.append(f"line {i}: a torn line (cut off mid-write)")
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            out.dropped.append(f"line {i}: not UTF-8 (byte 0x{line[e.start]:02x} at column "
                               f"{e.start + 1})")
            continue
        except ValueError:
            out.dropped.append(f"line {i}: not valid JSON (torn or damaged)")
            continue
        if not isinstance(rec, dict):
            out.dropped.append(f"line {i}: not a record")
            continue
        why = problem(rec) if problem else None
        if why:
            out.dropped.append(f"line {i}: {why}")
            continue
        (out.events if "event" in rec else out.records).append(rec)
        out.ordered.append(rec)
    return out


def read_metrics(path: str, problem: Problem | None = None) -> tuple[list[dict], int]:
    """(step records, lines dropped); dropped = -1 when the file does not exist."""
    m = read_metrics_file(path, problem)
    return m.records, len(m.dropped) if m.exists else -1


def rewrite_metrics(path: str, last_step: int,
                    problem: Problem | None = None) -> tuple[int, list[str]]:
    """Keep the records (and events) of steps ``<= last_step``; drop damaged lines.

    A resume continues from the checkpoint's step: steps after it were computed by
    an attempt whose state was lost and are computed again, so keeping both would
    show them twice. Returns (records removed, notes on the lines dropped). Atomic.
    """
    m = read_metrics_file(path, problem)
    if not m.exists:
        return 0, []
    keep = [r for r in m.ordered if isinstance(r.get("step"), int) and r["step"] <= last_step]
    removed = len(m.ordered) - len(keep)
    if removed or m.dropped:
        write_text(path, "".join(dumps(r) + "\n" for r in keep), "the cleaned metrics")
    return removed, m.dropped


def truncate_metrics(path: str, last_step: int, problem: Problem | None = None) -> int:
    """:func:`rewrite_metrics`, returning only the number of records removed."""
    return rewrite_metrics(path, last_step, problem)[0]


class MetricsWriter:
    """Appends one record per line to ``metrics.jsonl``: whole lines or nothing.

    ``fail``, a fault seam for tests (``GRADSYNC_FAULT=0:S:eio``), returns an errno
    for a record whose write should fail halfway, as a disk failing mid-line does.
    """

    def __init__(self, path: str, fail: Callable[[dict], int | None] | None = None):
        self.path, self._fail = path, fail
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise storage_error(e, "metrics", path) from None

    def write(self, record) -> None:
        rec = record.to_json() if hasattr(record, "to_json") else record
        data = memoryview((dumps(rec) + "\n").encode("utf-8"))
        size = os.fstat(self._fd).st_size
        injected = self._fail(rec) if self._fail else None
        try:
            if injected:
                os.write(self._fd, data[:len(data) // 2])
                raise OSError(injected, os.strerror(injected))
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # no half line left behind (shrinking needs no space)
            what = f"step {rec['step']}" if "step" in rec else "this record"
            raise storage_error(e, "metrics", self.path,
                                f" ({what} not recorded; the lines before it are intact)") from None

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
