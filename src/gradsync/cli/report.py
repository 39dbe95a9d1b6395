"""`gradsync report RUN_DIR`: write report.html and the figures of a run (finished or not)."""

from __future__ import annotations

import argparse


def register(sub, help_line: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report", help=help_line,
        description=help_line[0].upper() + help_line[1:] + ". The page is self-contained "
        "(opens offline); the same figures are written as PNG files beside it. A run that "
        "was cut off is reported as far as it got, with what is missing listed.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (gradsync train --out)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from ..observe.report import write_report

    result = write_report(args.run_dir)
    print(f"gradsync report: wrote {result.html} and {len(result.pngs)} figure(s)")
    for line in result.missing:
        print(f"gradsync report: missing: {line}")
    return 0
