"""The end-of-run table of `gradsync train --ft-groups N`: what each group went through."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from ..rundir import METRICS, read_metrics


def group_figures(path: str) -> dict:
    """Committed steps, redone steps, heals and seconds lost, from one group's metrics."""
    rows = [r for r in read_metrics(path)[0] if isinstance(r.get("step"), int) and "loss" in r]
    return {"steps": len(rows), "last": max((r["step"] for r in rows), default=0),
            "redone": sum(1 for r in rows if (r.get("attempts") or 1) > 1),
            "healed": sum(1 for r in rows if r.get("healed")),
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
