"""Rank 0's view of a run: a live progress bar and a closing table (metrics: gradsync.rundir).

On a terminal the bar redraws in place; in a log (CI, a pipe) it prints a plain
line every tenth of the run instead, so logs stay readable.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class RunDisplay:
    def __init__(self, total_steps: int, start_step: int, unit: str):
        self.console = Console(file=sys.stdout)
        self.total = total_steps
        self.unit = unit
        self.live = self.console.is_terminal
        self._every = max(1, total_steps // 10)
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[rate]:>9,.0f} " + unit + "/s"),
            TextColumn("{task.fields[step_ms]:>6.0f} ms/step"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task = self.progress.add_task(
            "train",
            total=total_steps,
            completed=start_step,
            loss=float("nan"),
            rate=0.0,
            step_ms=0.0,
        )

    def __enter__(self) -> RunDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, rate: float, step_s: float,
               eval_loss: float | None = None) -> None:
        self.progress.update(self.task, completed=step, loss=loss, rate=rate, step_ms=step_s * 1e3)
        if eval_loss is not None:
            self.console.print(f"step {step}/{self.total}  eval loss {eval_loss:.4f}",
                               highlight=False, soft_wrap=True)
        if not self.live and (step % self._every == 0 or step == self.total):
            self.console.print(
                f"step {step}/{self.total}  loss {loss:.4f}  "
                f"{rate:,.0f} {self.unit}/s  {step_s * 1e3:.0f} ms/step",
                highlight=False, soft_wrap=True,
            )

    def say(self, line: str) -> None:
        """One line, never wrapped (logs are read by people and by scripts)."""
        self.console.print(line, highlight=False, soft_wrap=True)

    def summary(self, rows: list[tuple[str, str]], title: str) -> None:
        table = Table(title=title, show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)
