"""Restarts that are seen: which worker died, how, when, and the step the run went on from.

Under ``--max-restarts`` the elastic agent restarts every worker after a failure,
and the run continues from its last checkpoint -- which used to show only as
"resuming from step N". Now the launcher (``gradsync train``) hands the failed
attempt's record (``launch.restart_failures``: rank, signal or exit code, time)
to the run directory as :data:`PENDING` before the new workers start; the new
attempt's rank 0 turns it into one progress line and one ``metrics.jsonl``
record, ``{"event": "restart", "step": <the step resumed from>, ...}``, and
removes it. Under torchrun, whose agent is not ours, the record says what a
worker knows: that this is restart N, and the step it resumed from.
"""

from __future__ import annotations

import contextlib
import os
import time

from ... import dist as gdist
from ...rundir import read_json, write_json

PENDING = "restart.json"  # written by the launcher between attempts, consumed by rank 0


def record_pending(out: str, max_restarts: int):
    """The launcher's ``on_restart`` callback: keep the failed attempt's record for rank 0."""

    def on_restart(failures: list[dict]) -> None:
        path = os.path.join(out, PENDING)
        before = read_json(path)
        attempts = before.get("attempts", []) if isinstance(before, dict) else []
        attempts.append({"failures": failures, "unix_time": time.time()})
        write_json(path, {"max_restarts": max_restarts, "attempts": attempts}, indent=1)

    return on_restart


def _clock(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def restart_line(event: dict) -> str:
    """One line for the progress display (and the tests)."""
    of = f" of {event['max_restarts']}" if event.get("max_restarts") else ""
    during = (f" during step {event['reached_step'] + 1}"
              if isinstance(event.get("reached_step"), int) else "")
    failed = event.get("failed") or []
    if failed:
        root = failed[0]
        who = f"worker rank {root['rank']} {root['how']} at {_clock(root.get('unix_time'))}{during}"
        if len(failed) > 1:
            who += f" (then rank(s) {', '.join(str(f['rank']) for f in failed[1:])} lost it)"
    else:
        who = (f"the launcher restarted the workers{during} (after a failure or a change of "
               "membership: its log says which)")
    return f"gradsync train: restart {event['attempt']}{of}: {who}; continuing from step " \
           f"{event['step']}"


def note_restart(sess, reached: int | None) -> dict | None:
    """Rank 0 of a restarted attempt: say it, record it in metrics.jsonl; None on attempt 0.

    ``reached``: the last step metrics.jsonl held before it was cut back to the
    checkpoint (the failed attempt died during the step after it).
    """
    attempt = gdist.restart_count()
    path = os.path.join(sess.cfg.run.out, PENDING)
    pending = read_json(path)
    pending = pending if isinstance(pending, dict) else {}
    if attempt < 1:
        with contextlib.suppress(OSError):  # left by a launcher killed between attempts
            os.remove(path)
        return None
    last = (pending.get("attempts") or [{}])[-1]
    event = {"event": "restart", "step": sess.start_step, "attempt": attempt,
             "max_restarts": pending.get("max_restarts") or sess.cfg.run.max_restarts or None,
             "failed": last.get("failures") or [], "reached_step": reached,
             "world_size": sess.world, "unix_time": time.time()}
    event = {k: v for k, v in event.items() if v is not None}
    sess.writer.write(event)
    sess.display.say(restart_line(event))
    with contextlib.suppress(OSError):
        os.remove(path)
    return event


def where_to_continue(out: str, trust_code: bool, command: str, failed: bool = False) -> str:
    """Where a stopped run stands, in one line: the last complete checkpoint and the
    ``command`` that continues from it (resuming is automatic), or why there is none.

    After a failure (``failed``) the command continues once its cause is fixed: rerunning
    a model error repeats it. The checkpoint is verified and read as data only (unless
    ``trust_code``): a damaged one is never offered as a step to continue from.
    """
    from ...errors import UsageError
    from ...rundir import CHECKPOINT
    from ...safeload import trusting
    from .unit import read_unit

    ckpt = os.path.join(out, CHECKPOINT)
    try:
        with trusting(trust_code):  # data only, unless the user opted in
            header = read_unit(ckpt)
    except UsageError as e:
        return f"no usable checkpoint to continue from: {e}"
    fixed = "once the cause is fixed, " if failed else ""
    if header is None:
        return f"no checkpoint had been written yet; {fixed}the same command starts again"
    return (f"the last complete checkpoint ({ckpt}, step {header['step']}) is intact; "
            f"{fixed}continue from step {header['step']} with: {command}")
