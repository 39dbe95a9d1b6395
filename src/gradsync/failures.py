"""What a failed worker group is reported as: the root-cause rank first, in a line.

When one worker dies its peers fail too, with broken connections (gloo's
"Connection reset by peer") that say nothing about the cause; those echoes are
told apart from root causes here, so the launcher's error and a restart's record
name the rank that failed first and how (a signal, an exit code, an exception).
"""

from __future__ import annotations

import re

from . import dist as gdist
from .errors import WorkerFailedError

# Failures that are consequences of another rank's failure, not causes.
SECONDARY = re.compile(
    r"Connection (closed|reset)|Broken pipe|ECONNRESET|Timed out|timed out|DistBackendError|"
    r"peer|SIGTERM|Signal 15", re.IGNORECASE)


def _failure_text(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        text = msg.get("message", "")
        stack = msg.get("extraInfo", {}).get("py_callstack", "")
        return text + (f"\n{stack}" if stack and text not in ("", stack) else "")
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    if failure.exitcode == gdist.CONNECT_EXIT_CODE:
        return "could not connect to its peers: process-group set-up timed out"
    if not msg or "enable traceback" in msg:
        return f"exited with code {failure.exitcode} without raising a Python exception"
    return str(msg)


def summary_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if not ln.startswith((" ", "Traceback")):
            return ln.strip()
    return lines[-1].strip() if lines else "unknown error"


def _root_first(failures: dict) -> tuple[dict[int, str], list[int]]:
    """(rank -> failure text, ranks ordered root cause first: echoes of a peer's death last)."""
    texts = {rank: _failure_text(f) for rank, f in failures.items()}

    def key(rank):
        secondary = bool(SECONDARY.search(summary_line(texts[rank])))
        return (secondary, failures[rank].timestamp, rank)

    return texts, sorted(texts, key=key)


def describe_failures(err) -> WorkerFailedError:
    """Turn elastic's failure record (a ChildFailedError) into one error naming the root cause."""
    texts, ordered = _root_first(err.failures)
    root = ordered[0]
    lines = [f"worker rank {root} failed: {summary_line(texts[root])}"]
    others = [r for r in ordered[1:]]
    if others:
        lines.append("also failed: " + "; ".join(
            f"rank {r}: {summary_line(texts[r])}" for r in others))
    lines.append(f"--- rank {root} ---\n{texts[root].rstrip()}")
    return WorkerFailedError("\n".join(lines), texts)


def restart_failures(failures: dict) -> list[dict]:
    """What a restart reports of the attempt that failed: rank, how, when; root cause first."""
    texts, ordered = _root_first(failures)
    out = []
    for rank in ordered:
        f = failures[rank]
        how = (f"was killed by signal {f.signal_name()}" if f.exitcode < 0 else
               f"exited with code {f.exitcode}: {summary_line(texts[rank])}")
        out.append({"rank": rank, "how": how, "exitcode": f.exitcode,
                    "signal": f.signal_name() if f.exitcode < 0 else None,
                    "unix_time": f.timestamp})
    return out
