"""Which part of gradsync may import which: one table, every module, every import.

Every ``.py`` file under ``src/gradsync`` is parsed (imports inside functions
included: a lazy import hides a dependency, it does not remove it), each import
is resolved to the module it names, and both ends are placed in an area of
:data:`RANK`. An import is allowed when its target's rank is lower than the
importer's, or when both lie in the same area. Areas of equal rank (``sharded``
and ``local``; ``netlab`` and ``train``) do not
import each other. A module in no area fails the test, so a new package has to
be placed in the table before it lands.

Two exceptions, written as rules rather than ranks:
* ``plan`` is pure arithmetic and reaches into the engine for exactly one module,
  ``engine.buckets.plan`` (the bucket function the engine and the simulator share);
* the package root ``gradsync`` (the lazy public API) re-exports from every area,
  and only areas above the engine may import it: below, it would hide an upward
  import behind a lazy name.

Inside an area imports may go either way, but never round: :func:`cycles` finds every
import cycle among the modules, in-function imports included (an import moved into a
function to dodge a cycle still closes it), and the tree must have none.

``docs/architecture.md`` says the same things to a reader, and is held to the files:
its table of areas lists exactly :data:`RANK`, and its tree names exactly the packages
and modules under ``src/gradsync`` (:func:`doc_problems`).
"""

from __future__ import annotations

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
DOC = SRC.parent / "docs" / "architecture.md"

# lowest first; an area may import areas of lower rank and itself
RANK = {
    "errors": 0, "heap": 0, "lifeline": 0, "forkserver": 0, "sigint": 0, "runfiles": 0.5,
    "atomic": 0.25,  # the one atomic writer: runfiles, engine shards and train write through it
    "failures": 1.5,  # launch's reading of a failed worker group (below launch, above dist)
    "ownership": 0.75,  # which directories gradsync may write into (train and export ask it)
    "nccl_rules": 0.9,  # NCCL's rules on gloo (dist initialises it)
    "dist": 1, "factory": 1, "rundir": 1, "models": 1,
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
    "data": 3.7,  # samplers, the speed balancer: its collectives through the engine's door
    "plan": 4,
    "calibrate": 5,
    "observe": 6,
    "ft": 6.5,  # replica groups on torchft, and the loop's side of the quorum (it takes the
    # worker's session as an object): above the engine and data, below train, its caller
    "netlab": 7, "train": 7,
    # `gradsync verify`: the built-in exactness check, and the same check on the user's own
    # model and data read exactly as `gradsync train` reads them (train's task), so above train
    "checks": 7.5,
    "cli": 8, "__main__": 9,  # `python -m gradsync` runs the CLI
}
PLAN_MAY_IMPORT = {"gradsync.engine.buckets.plan"}
ROOT = "gradsync"  # the package root: the public, lazy API


def area(module: str) -> str | None:
    """``gradsync.engine.sync.core`` -> ``engine.sync``; ``gradsync.train.worker.loop``
    -> ``train``."""
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


def import_graph(src: pathlib.Path = SRC) -> dict[str, dict[str, str]]:
    """module -> {gradsync module it imports: where ("path:line")}, every import counted."""
    known = modules(src)
    graph: dict[str, dict[str, str]] = {}
    for name, (path, is_pkg) in known.items():
        edges = graph.setdefault(name, {})
        for line, target in imports(name, path, is_pkg, known):
            if target in known and target != name:
                edges.setdefault(target, f"{path.relative_to(src / 'gradsync')}:{line}")
    return graph


def _strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycles(src: pathlib.Path = SRC) -> list[str]:
    """One line per import cycle: a shortest way round it from its first module, with
    the file and line of every import on the way."""
    graph = import_graph(src)
    lines = []
    for component in _strongly_connected(graph):
        inside, start = set(component), component[0]
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:  # breadth first, back to the start
            nxt = []
            for node in frontier:
                for child in sorted(graph[node]):
                    if child in inside and child not in came_from:
                        came_from[child] = node
                        nxt.append(child)
            frontier = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        path.reverse()
        where = ", ".join(graph[a][b] for a, b in zip(path, path[1:]))
        lines.append(f"{' -> '.join(path)} ({where})")
    return lines


def test_every_import_goes_down_the_layers():
    assert len(modules(SRC)) > 100  # the walk found the package
    assert violations() == []


def test_no_import_cycle_anywhere():
    """Also none closed by an import inside a function: move the shared piece down."""
    assert cycles() == []


# ------------------------------------------------------------------ the architecture page
def doc_tree(text: str) -> set[str]:
    """The paths the page's tree names (the fenced block under "## The tree"): folders
    end in "/", relative to ``src/gradsync``; two spaces of indent per level, and what
    follows a name on its line is the reader's, not checked."""
    block = text.split("\n## The tree", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        if depth == 0:  # the root line, "gradsync/"
            stack = []
            continue
        stack = stack[:depth - 1] + [name]
        paths.add("".join(stack))  # a folder's name ends in "/"
    return paths


def source_tree(src: pathlib.Path = SRC) -> set[str]:
    """Every folder (with a "/") and module of ``src/gradsync``, ``__init__.py`` left out:
    the folder stands for it."""
    root = src / "gradsync"
    out = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        out.update("/".join(rel.parts[:i]) + "/" for i in range(1, len(rel.parts)))
        if path.name != "__init__.py":
            out.add(str(rel))
    return out


def doc_areas(text: str) -> dict[str, float]:
    """The page's table of areas (under "## Who may import whom"): area -> rank."""
    section = text.split("\n## Who may import whom", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *([0-9.]+) *\| *`([\w.]+)` *\|", section, re.M)
    return {name: float(rank) for rank, name in rows}


def doc_problems(text: str, src: pathlib.Path = SRC, rank: dict | None = None) -> list[str]:
    """What the page says that the files or the table do not (empty: it is true)."""
    rank = RANK if rank is None else rank
    problems = []
    on_page, on_disk = doc_tree(text), source_tree(src)
    problems += [f"the tree lacks {p}" for p in sorted(on_disk - on_page)]
    problems += [f"the tree names {p}, which is not in src/gradsync" for p in
                 sorted(on_page - on_disk)]
    areas = doc_areas(text)
    for name in sorted(set(rank) | set(areas)):
        if areas.get(name) != rank.get(name):
            problems.append(f"the table of areas gives {name} rank {areas.get(name)}, "
                            f"tests/test_layering.py's RANK {rank.get(name)}")
    return problems


def test_the_architecture_page_matches_the_files_and_the_table():
    assert doc_problems(DOC.read_text()) == []


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


def test_a_clean_tree_has_no_cycle(tmp_path):
    assert cycles(_tree(tmp_path, BASE)) == []


def test_a_planted_cycle_is_named_with_its_imports(tmp_path):
    planted = dict(BASE)
    planted["train/a.py"] = "from . import b\n"
    planted["train/b.py"] = "def f():\n    from .c import x\n"  # inside a function: counted
    planted["train/c.py"] = "from .a import y\n"
    planted["train/d.py"] = "from . import a, b\n"  # imports into the cycle, not part of it
    found = cycles(_tree(tmp_path, planted))
    assert found == ["gradsync.train.a -> gradsync.train.b -> gradsync.train.c -> "
                     "gradsync.train.a (train/a.py:1, train/b.py:2, train/c.py:1)"], found
    assert violations(_tree(tmp_path, planted)) == []  # the layers alone would not see it


PAGE = """# x

## Who may import whom

| rank | area | job |
|---|---|---|
| 0 | `errors` | the exceptions |
| 3.0 | `engine.transport` | bytes |

## The tree

```
gradsync/
  errors.py        the exceptions
  engine/          the runtime
    transport/
      comm.py
```
"""


def test_the_page_is_read_as_the_files_it_names(tmp_path):
    src = _tree(tmp_path, {"__init__.py": "", "errors.py": "", "engine/__init__.py": "",
                           "engine/transport/__init__.py": "",
                           "engine/transport/comm.py": ""})
    rank = {"errors": 0, "engine.transport": 3.0}
    assert doc_tree(PAGE) == {"errors.py", "engine/", "engine/transport/",
                              "engine/transport/comm.py"}
    assert doc_problems(PAGE, src, rank) == []
    (src / "gradsync" / "engine" / "transport" / "ring.py").write_text("")
    stale = PAGE.replace("| 3.0 |", "| 3.1 |").replace("  errors.py", "  error.py")
    assert doc_problems(stale, src, rank) == [
        "the tree lacks engine/transport/ring.py", "the tree lacks errors.py",
        "the tree names error.py, which is not in src/gradsync",
        "the table of areas gives engine.transport rank 3.1, tests/test_layering.py's RANK 3.0"]
