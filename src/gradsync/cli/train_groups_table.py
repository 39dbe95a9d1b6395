"""The end-of-run table of `gradsync train --ft-groups N`: what each group went through."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from ..rundir import METRICS, read_metrics_file


def group_figures(path: str) -> dict:
    """Committed steps, redone steps, heals and seconds lost, from one group's metrics; a
    group that healed into the job's end (``ft/closing.py``) holds its last step too."""
    m = read_metrics_file(path)
    rows = [r for r in m.records if isinstance(r.get("step"), int) and "loss" in r]
    ends = [e for e in m.events if e.get("event") == "end" and isinstance(e.get("step"), int)]
    last = max([r["step"] for r in rows] + [e["step"] for e in ends if e.get("final")],
               default=0)
    return {"steps": len(rows), "last": last,
            "redone": sum(1 for r in rows if (r.get("attempts") or 1) > 1),
            "healed": sum(1 for r in rows if r.get("healed")) + sum(
                1 for e in ends if e.get("healed")),
            "lost_s": sum((r.get("lost_s") or 0.0) for r in rows)}


def print_table(out: str, codes: list) -> None:
    """One row per group: exit code (None: stopped), steps, redone, healed, seconds lost."""
    table = Table(title=f"replica groups ({out})")
    for col in ("group", "exit", "steps here", "last step", "redone", "healed", "seconds lost"):
        table.add_column(col, justify="right")
    for g, code in enumerate(codes):
        f = group_figures(os.path.join(out, f"group-{g}", METRICS))
        table.add_row(str(g), "stopped" if code is None else str(code), str(f["steps"]),
                      str(f["last"]), str(f["redone"]), str(f["healed"]), f"{f['lost_s']:.1f}")
    Console(width=100).print(table)
