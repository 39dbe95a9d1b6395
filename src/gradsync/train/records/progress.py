"""Rank 0's view of a run: a live progress bar and a closing table (metrics: gradsync.rundir).

On a terminal the bar redraws in place; in a log (CI, a pipe) it prints a plain
line every tenth of the run instead, so logs stay readable.

The bar fits the terminal: its text is measured for the longest step count and a
compact rate ("12.3k tokens/s"), the bar takes what is left (10 to 40 columns),
and on a narrow terminal (under 100 columns: the usual 80) the ms/step column,
which the rate already says, is left out, so the elapsed and remaining times are
never cut. Before the first step there is no loss and no rate: it shows "-",
not "nan" and "0 tokens/s".
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

NO_VALUE = "-"
WIDE = 100  # columns from which ms/step is shown beside the rate
LOSS_W = len("loss 12.3456")


def compact_rate(rate: float) -> str:
    """1234 -> '1,234'; 12345 -> '12.3k'; 1.5e6 -> '1.50M': at most 6 characters."""
    if rate < 1e4:
        return f"{rate:,.0f}"
    if rate < 1e6:
        return f"{rate / 1e3:.1f}k" if rate < 1e5 else f"{rate / 1e3:.0f}k"
    return f"{rate / 1e6:.2f}M" if rate < 1e7 else f"{rate / 1e6:.0f}M"


class RunDisplay:
    def __init__(self, total_steps: int, start_step: int, unit: str,
                 console: Console | None = None):
        self.console = console or Console(file=sys.stdout)  # a test passes its own
        self.total = total_steps
        self.unit = unit
        self.live = self.console.is_terminal
        self._every = max(1, total_steps // 10)
        steps_w = len(f"step {total_steps}/{total_steps}")
        rate_w = len(f"999.9k {unit}/s")
        self.show_ms = self.console.width >= WIDE
        text = [steps_w, LOSS_W, rate_w, 7, 7] + ([len("99999 ms/step")] if self.show_ms else [])
        used = sum(text) + len(text)  # one space between columns
        bar_w = max(10, min(40, self.console.width - used - 1))
        columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=bar_w),
                   TextColumn(f"{{task.fields[loss]:<{LOSS_W}}}"),
                   TextColumn(f"{{task.fields[rate]:>{rate_w}}}")]
        if self.show_ms:
            columns.append(TextColumn("{task.fields[step_ms]:>13}"))
        self.progress = Progress(*columns, TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=self.console, disable=not self.live)
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start_step, loss=f"loss {NO_VALUE}",
            rate=f"{NO_VALUE} {unit}/s", step_ms=f"{NO_VALUE} ms/step",
        )

    def __enter__(self) -> RunDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, rate: float, step_s: float,
               eval_loss: float | None = None) -> None:
        self.progress.update(self.task, completed=step, loss=f"loss {loss:.4f}",
                             rate=f"{compact_rate(rate)} {self.unit}/s",
                             step_ms=f"{step_s * 1e3:.0f} ms/step")
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
        """One line, never wrapped (logs are read by people and by scripts); taken as
        plain text (an error's ``[/path/file.cc:537]`` is not rich markup)."""
        self.console.print(line, highlight=False, soft_wrap=True, markup=False)

    def summary(self, rows: list[tuple[str, str]], title: str) -> None:
        table = Table(title=title, show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)
