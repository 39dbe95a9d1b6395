"""The engine never imports observe/, plan/ or cli/ (DESIGN: layout), tracer included.

The tracer's recording half lives in the engine precisely so this holds: the
engine must stay importable and cheap without matplotlib, the report or the
planner.
"""

import pathlib
import re

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "src" / "gradsync" / "engine"
FORBIDDEN = re.compile(r"^\s*(from|import)\s+(\.\.|gradsync\.)(observe|plan|cli)\b", re.M)


def test_engine_does_not_import_observe_plan_or_cli():
    offenders = [f.name for f in ENGINE.glob("*.py") if FORBIDDEN.search(f.read_text())]
    assert offenders == []
    assert (ENGINE / "tracing.py").exists() and (ENGINE / "drift.py").exists()
