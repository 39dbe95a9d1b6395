"""``--log csv``: ``RUN/metrics.csv``, one row per step, written by ``csv.DictWriter``.

The columns are the scalar fields of a step record (``rundir.StepRecord``, in its
order) and any other number the records carry (an eval metric as
``eval_metrics/NAME``); per-rank lists stay in metrics.jsonl. Each open rewrites
the file from metrics.jsonl, which the resume has just cut back to the checkpoint,
so the CSV always matches it; a column first seen mid-run (an eval metric at the
first evaluation) rewrites it the same way, with the new column.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import fields

from ....rundir import METRICS, METRICS_CSV, StepRecord, read_metrics, write_text
from .base import SKIP_KEYS, Outcome, Start, Tracker, scalars


def _record_columns() -> list[str]:
    """StepRecord's fields but its lists and dicts (their annotations are strings)."""
    return [f.name for f in fields(StepRecord)
            if "list" not in str(f.type) and "dict" not in str(f.type)]


def _row(record: dict) -> dict:
    row = {k: record.get(k) for k in SKIP_KEYS if k in record}
    if isinstance(record.get("skipped"), bool):
        row["skipped"] = int(record["skipped"])
    row.update(scalars(record))
    return row


class CsvTracker(Tracker):
    name = "csv"

    def __init__(self, start: Start):
        self.path = os.path.join(start.out, METRICS_CSV)
        self.metrics = os.path.join(start.out, METRICS)
        self.file = None
        self._rewrite(start.history)
        self.through = start.step  # what it holds: metrics.jsonl up to the checkpoint
        self.state = {"file": METRICS_CSV}

    def _rewrite(self, records: list[dict]) -> None:
        """metrics.csv from ``records``, atomically, then opened for appending."""
        if self.file is not None:
            self.file.close()
        rows = [_row(r) for r in records]
        columns = _record_columns()
        columns += sorted({k for r in rows for k in r} - set(columns))
        text = io.StringIO()
        w = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        write_text(self.path, text.getvalue(), "metrics.csv")
        self.columns = columns
        self.file = open(self.path, "a", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.file, fieldnames=columns, lineterminator="\n")

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        row = _row(record)
        if set(row) - set(self.columns):  # a new column: from metrics.jsonl, which has it
            records, _ = read_metrics(self.metrics)
            self._rewrite([r for r in records if isinstance(r.get("step"), int)
                           and r["step"] <= step])
            return
        self.writer.writerow(row)
        self.file.flush()

    def close(self, outcome: Outcome) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def open_tracker(start: Start) -> Tracker:
    return CsvTracker(start)
