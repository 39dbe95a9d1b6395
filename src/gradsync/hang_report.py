"""Which rank is behind, and at which collective: the launcher's report after a hang.

A collective that times out (gloo raises on the ranks that wait, after the
process group's timeout: ``GRADSYNC_TIMEOUT_S``, ``spawn(timeout_s=...)``) or
loses its peer makes each waiting rank write its flight record (the engine's
``transport/flight_recorder.py``: the last collectives with sequence numbers) to
:func:`flight_dir`. A rank that sleeps, computes or died writes none, and that is
itself the answer: it never reached the collective the others wait in. The
launcher (``launch.py``) reads every file and puts a few lines in front of its
error::

    hang report (flight records in /tmp/gradsync-flight/gradsync-1a2b):
      rank 0 waited 3.0 s in all_reduce #2 'b' (float32 x 4, group world): RuntimeError: ...
      rank 1 is behind: it never issued #2 on group world (no flight record: it was not
        waiting in a collective); all ranks completed all_reduce #1 'a'

Only files, no engine import: this sits below the launcher, and the engine
imports :func:`flight_path` from here so both agree where records live.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import tempfile


def flight_dir(run_id: str | None = None) -> pathlib.Path:
    """``GRADSYNC_FLIGHT_DIR``, else ``<tmp>/gradsync-flight/<torchelastic run id>``."""
    explicit = os.environ.get("GRADSYNC_FLIGHT_DIR")
    if explicit:
        return pathlib.Path(explicit)
    run = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getppid()}"
    return pathlib.Path(tempfile.gettempdir()) / "gradsync-flight" / run


def flight_path(rank: int, run_id: str | None = None) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return str(flight_dir(run_id) / f"attempt-{attempt}" / f"rank-{rank}.json")


def read_records(directory: pathlib.Path) -> dict[int, dict]:
    """``{rank: flight record}`` of the latest attempt in ``directory`` (unreadable
    files are skipped: a report must never fail the launcher)."""
    attempts = sorted(directory.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1])
                      if p.name.split("-")[1].isdigit() else -1)
    if not attempts:
        return {}
    out = {}
    for f in attempts[-1].glob("rank-*.json"):
        try:
            data = json.loads(f.read_text())
            out[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _name(rec: dict) -> str:
    tag = f" '{rec['tag']}'" if rec.get("tag") else ""
    return f"{rec['op']} #{rec['seq']}{tag}"


def _full(rec: dict) -> str:
    return f"{_name(rec)} ({rec['dtype']} x {rec['numel']}, group {rec['group']})"


def _summary(text: str) -> str:
    for line in (text or "").strip().splitlines():
        if line.strip() and not line.startswith((" ", "Traceback")):
            return re.sub(r"\[/[^\]]*\] ", "", line.strip())[:160]  # gloo's source path
    return ""


def report(records: dict[int, dict], failures: dict[int, str] | None = None,
           directory: str = "") -> str:
    """A few lines naming the rank(s) behind and the collective; "" without records."""
    failures = failures or {}
    stuck = {r: d["stuck"] for r, d in records.items() if d.get("stuck")}
    if not stuck:
        return ""
    first_rank = min(stuck, key=lambda r: (stuck[r]["start"], r))
    x = stuck[first_rank]
    lines = [f"hang report (flight records in {directory}):" if directory else "hang report:"]
    waited = {r: s for r, s in stuck.items()
              if (s["group"], s["seq"]) == (x["group"], x["seq"])}
    same = sorted(r for r, s in waited.items() if (s["op"], s["numel"]) == (x["op"], x["numel"]))
    for r in same:
        s, err = waited[r], _summary(records[r].get("error", ""))
        secs = (s.get("end") or records[r]["time"]) - s["start"]
        lines.append(f"  rank {r} waited {secs:.1f} s in {_full(s)}" + (f": {err}" if err else ""))
    done = [rec for rec in records[first_rank]["records"]
            if rec["group"] == x["group"] and rec["state"] == "completed"]
    last_all = f"; all ranks completed {_name(done[-1])}" if done else ""
    behind, other = [], []
    for m in x.get("ranks") or sorted(records):
        if m in same:
            continue
        if m not in records:
            why = _summary(failures.get(m, "")) or "it was not waiting in a collective"
            behind.append(f"  rank {m} is behind: it never issued #{x['seq']} on group "
                          f"{x['group']} (no flight record: {why}){last_all}")
            continue
        mine = [rec for rec in records[m]["records"] if rec["group"] == x["group"]]
        at = next((rec for rec in mine if rec["seq"] == x["seq"]), None)
        own = records[m].get("stuck")
        where = f"; it waits in {_full(own)}" if own and own["seq"] != x["seq"] else ""
        if at is None:
            last = f"its last was {_name(mine[-1])}" if mine else "none issued"
            behind.append(f"  rank {m} is behind: it never issued #{x['seq']} on group "
                          f"{x['group']} ({last}){where}")
        elif (at["op"], at["numel"], at["dtype"]) != (x["op"], x["numel"], x["dtype"]) \
                or at.get("tag") != x.get("tag"):
            state = "and waits in it" if at.get("state") == "failed" else f"({at['state']})"
            other.append(f"  rank {m} issued {_full(at)} instead, {state}: one of them "
                         f"skipped a collective or issued an extra one{where}")
    lines += behind + other
    if not behind and not other:
        lines.append("  every rank of the group reached it; the slowest was "
                     f"rank {max(same, key=lambda r: waited[r]['start'])}")
    return "\n".join(lines)


def attach(error, run_id: str | None = None):
    """The launcher's call: ``error`` (a WorkerFailedError) with the hang report in
    front of its message, printed to stderr too; ``error`` itself when no rank left
    a flight record."""
    try:
        directory = flight_dir(run_id)
        text = report(read_records(directory), getattr(error, "failures", {}), str(directory))
    except Exception:  # noqa: BLE001 - the report is a courtesy; the error must get out
        return error
    if not text:
        return error
    print(text, file=sys.stderr, flush=True)
    new = type(error)(f"{text}\n{error}", getattr(error, "failures", None))
    return new
