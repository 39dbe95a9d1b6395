"""Which part of gradsync may import which: one table, every module, every import.

Every ``.py`` file under ``src/gradsync`` is parsed (imports inside functions
included: a lazy import hides a dependency, it does not remove it), each import
is resolved to the module it names, and both ends are placed in an area of
:data:`RANK`. An import is allowed when its target's rank is lower than the
importer's, or when both lie in the same area. Areas of equal rank (``sharded``
and ``local``; ``calibrate`` and ``checks``; ``netlab`` and ``train``) do not
import each other. A module in no area fails the test, so a new package has to
be placed in the table before it lands.

Two exceptions, written as rules rather than ranks:
* ``plan`` is pure arithmetic and reaches into the engine for exactly one module,
  ``engine.buckets.plan`` (the bucket function the engine and the simulator share);
* the package root ``gradsync`` (the lazy public API) re-exports from every area,
  and only areas above the engine may import it: below, it would hide an upward
  import behind a lazy name.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# lowest first; an area may import areas of lower rank and itself
RANK = {
    "errors": 0, "heap": 0, "lifeline": 0, "forkserver": 0, "sigint": 0, "runfiles": 0.5,
    "atomic": 0.25,  # the one atomic writer: runfiles, engine shards and train write through it
    "failures": 1.5,  # launch's reading of a failed worker group (below launch, above dist)
    "ownership": 0.75,  # which directories gradsync may write into (train and export ask it)
    "dist": 1, "factory": 1, "rundir": 1, "models": 1, "data": 1,
    "safeload": 1,  # the one torch-file reader (weights only), below the engine that loads shards
    "hang_report": 1,  # reads flight records for launch; the engine writes them (below launch)
    "launch": 2,
    # the engine, by layer
    "engine": 3,  # engine/__init__.py, the package docstring
    "engine.transport": 3.0, "engine.sync": 3.1, "engine.buckets": 3.2,
    "engine.compress": 3.3, "engine.replicated": 3.4,
    "engine.sharded": 3.5, "engine.local": 3.5,
    "engine.strategy": 3.6,
    # above the engine
    "plan": 4,
    "calibrate": 5, "checks": 5,
    "observe": 6,
    "ft": 6.5,  # replica groups on torchft: above the engine and data, below train, its caller
    "netlab": 7, "train": 7,
    "cli": 8, "__main__": 9,  # `python -m gradsync` runs the CLI
}
PLAN_MAY_IMPORT = {"gradsync.engine.buckets.plan"}
ROOT = "gradsync"  # the package root: the public, lazy API


def area(module: str) -> str | None:
    """``gradsync.engine.sync.core`` -> ``engine.sync``; ``gradsync.train.loop`` -> ``train``."""
    parts = module.split(".")[1:]
    if not parts:
        return ROOT
    if parts[0] == "engine" and len(parts) > 1:
        name = f"engine.{parts[1]}"
        return name if name in RANK else None
    return parts[0] if parts[0] in RANK else None


def modules(src: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is package) for every module under ``src/gradsync``."""
    out = {}
    for path in sorted((src / "gradsync").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imports(name: str, path: pathlib.Path, is_pkg: bool, known) -> list[tuple[int, str]]:
    """(line, imported gradsync module) for every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import module` names the module
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return [(line, t) for line, t in found if t == ROOT or t.startswith(ROOT + ".")]


def violations(src: pathlib.Path = SRC) -> list[str]:
    known = modules(src)
    bad = []
    for name, (path, is_pkg) in known.items():
        if name == ROOT:
            continue  # the public API's lazy table names every area
        mine = area(name)
        if mine is None:
            bad.append(f"{name}: in no area; place it in tests/test_layering.py's RANK")
            continue
        for line, target in imports(name, path, is_pkg, known):
            theirs = area(target)
            where = f"{path.relative_to(src)}:{line} imports {target}"
            if theirs is None:
                bad.append(f"{where}: the target is in no area")
            elif theirs == ROOT:
                if RANK[mine] <= RANK["engine.strategy"]:
                    bad.append(f"{where}: the package root, from {mine} (engine or below)")
            elif mine == "plan" and theirs.startswith("engine"):
                if target not in PLAN_MAY_IMPORT:
                    bad.append(f"{where}: plan may import only {sorted(PLAN_MAY_IMPORT)}")
            elif theirs != mine and not RANK[theirs] < RANK[mine]:
                bad.append(f"{where}: {mine} (rank {RANK[mine]}) may not import "
                           f"{theirs} (rank {RANK[theirs]})")
    return bad


def test_every_import_goes_down_the_layers():
    assert len(modules(SRC)) > 100  # the walk found the package
    assert violations() == []


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    src = tmp_path / "src"
    for rel, text in files.items():
        path = src / "gradsync" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


BASE = {"__init__.py": "", "engine/__init__.py": "", "engine/sync/__init__.py": "",
        "engine/sync/core.py": "from ..transport import comm\n",
        "engine/transport/__init__.py": "", "engine/transport/comm.py": "",
        "engine/sharded/__init__.py": "", "engine/local/__init__.py": "",
        "engine/sharded/zero.py": "", "engine/local/diloco.py": "",
        "engine/buckets/__init__.py": "", "engine/buckets/plan.py": "",
        "engine/buckets/layout.py": "", "plan/__init__.py": "",
        "plan/simulate.py": "from ..engine.buckets.plan import plan_buckets\n",
        "observe/__init__.py": "", "train/__init__.py": ""}


def test_a_clean_tree_passes(tmp_path):
    assert violations(_tree(tmp_path, BASE)) == []


def test_planted_upward_imports_are_named(tmp_path):
    planted = dict(BASE)
    planted["engine/transport/comm.py"] = (  # inside a function: still counted
        "def f():\n    from ..sync import core\n")
    planted["engine/sharded/zero.py"] = "from ..local.diloco import x\n"  # siblings
    planted["engine/local/diloco.py"] = "import gradsync.observe\n"
    planted["engine/buckets/plan.py"] = "import gradsync as gs\n"
    planted["plan/simulate.py"] = "from ..engine.buckets import layout\n"
    planted["extra.py"] = ""
    bad = violations(_tree(tmp_path, planted))
    assert len(bad) == 6, bad
    expected = ["engine/transport/comm.py:2 imports gradsync.engine.sync.core",
                "engine/sharded/zero.py:1 imports gradsync.engine.local.diloco",
                "engine/local/diloco.py:1 imports gradsync.observe",
                "engine/buckets/plan.py:1 imports gradsync: the package root",
                "plan/simulate.py:1 imports gradsync.engine.buckets.layout",
                "gradsync.extra: in no area"]
    for text in expected:
        assert sum(text in b for b in bad) == 1, (text, bad)
