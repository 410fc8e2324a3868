"""The layers import one way: models <- parallel <- workers <- service <- api, and api talks to service
only (and to models, for presets). Every product module is parsed with `ast` (nothing is imported), and
every import counts, lazy ones inside functions too: an import moved into a function to dodge a cycle
is still a cycle, and so is one under `if TYPE_CHECKING:` (a type from the module that imports you is one
concept split in two). Inside service/ the folders are layers too: pool <- control <- sharing <- server.
The checker runs on a planted tree too, to show that it fails when it should.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("models", "parallel", "workers", "service", "api")
"""Lowest first: a module may import its own layer and the layers before it."""
SERVICE_LAYERS = ("pool", "control", "sharing", "server")
"""service/'s folders, lowest first: the worker pool, a job's state machine, cluster sharing (which tells
the jobs' state machines what to do), the server."""
API_MAY_IMPORT = frozenset({"api", "service", "models"})

# Known violations, as (importer, imported) module pairs; a cycle is excused by naming one of its imports.
# Issue 12 emptied it (api reaches workers/ and parallel/ only through service/; no circle through the
# coordinator). A new violation fails the test; an entry that no longer happens fails it too.
KNOWN: frozenset[tuple[str, str]] = frozenset()


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules(root: Path, layers: Iterable[str] = LAYERS) -> dict[str, Path]:
    return {module_name(root, p): p for layer in layers for p in sorted((root / layer).rglob("*.py"))}


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `name` imports (under `if TYPE_CHECKING:` too):
    `from a.b import c` is a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a module a.b.c; an attribute of a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def layer_problems(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs that import upward, or from api past service."""
    bad = set()
    for src, dsts in graph.items():
        here = src.split(".")[0]
        for dst in dsts:
            there = dst.split(".")[0]
            if LAYERS.index(there) > LAYERS.index(here) or (here == "api" and there not in API_MAY_IMPORT):
                bad.add((src, dst))
            elif here == there == "service" and _sub(src) in SERVICE_LAYERS and _sub(dst) in SERVICE_LAYERS \
                    and SERVICE_LAYERS.index(_sub(dst)) > SERVICE_LAYERS.index(_sub(src)):
                bad.add((src, dst))
    return bad


def _sub(module: str) -> str:
    """The folder of a service module (service.control.state -> control)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> str:
    top = module.split(".")[0]
    return f"service.{_sub(module)}" if top == "service" and _sub(module) in SERVICE_LAYERS else top


def check(root: Path, known: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per problem: a layer crossing not in `known`, or a cycle that no known pair breaks."""
    modules = product_modules(root)
    graph = {name: imports(name, path, modules) for name, path in modules.items()}
    problems = [f"{a} imports {b}: {_layer(b)} is not below {_layer(a)}"
                for a, b in sorted(layer_problems(graph) - known)]
    acyclic = {a: {b for b in dsts if (a, b) not in known} for a, dsts in graph.items()}
    problems += [f"import cycle among {', '.join(group)}" for group in cycles(acyclic)]
    return problems


def live_violations(root: Path) -> set[tuple[str, str]]:
    """Every import pair that crosses a layer or closes a cycle, with nothing allowed."""
    modules = product_modules(root)
    graph = {name: imports(name, path, modules) for name, path in modules.items()}
    in_cycles = {m for group in cycles(graph) for m in group}
    return layer_problems(graph) | {(a, b) for a in in_cycles for b in graph[a] if b in in_cycles}


def test_the_product_keeps_its_layers_and_has_no_import_cycle():
    assert check(ROOT, KNOWN) == []


def test_service_does_not_import_the_torchrun_entry_module():
    """workers/train.py is what torchrun runs; what service/ needs from it lives in workers/config.py."""
    modules = product_modules(ROOT)
    users = [m for m, p in modules.items() if m.startswith("service.") and "workers.train" in imports(m, p, modules)]
    assert users == []


def test_every_known_violation_still_happens_so_the_list_only_shrinks():
    assert KNOWN <= live_violations(ROOT), sorted(KNOWN - live_violations(ROOT))


def test_the_checker_reports_a_planted_upward_import_an_api_shortcut_and_a_cycle(tmp_path):
    files = {
        "models/config.py": "import math\n",
        "parallel/__init__.py": "",
        "parallel/layout.py": "from models.config import math\n",
        "parallel/planner.py": "def f():\n    from workers.config import X  # planted: upward, and lazy\n",
        "workers/config.py": "from parallel import layout\n",
        "workers/a.py": "import workers.b\n",
        "workers/b.py": "from . import c\n",
        "workers/c.py": "from workers.a import thing\n",  # planted: a -> b -> c -> a
        "workers/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.e import E\n",
        "workers/e.py": "import workers.d\n",  # planted: a cycle, though d's import of e never runs
        "service/typed.py": "import typing\nif typing.TYPE_CHECKING:\n    from api import app\n",  # planted
        "service/jobs.py": "from workers import config\n",
        "service/pool/__init__.py": "",
        "service/pool/group.py": "from service.control import state\n",  # planted: pool past control
        "service/control/__init__.py": "",
        "service/control/state.py": "from service.pool import group\n",
        "api/app.py": "from service.jobs import run\nfrom models.config import math\n",
        "api/cli.py": "import parallel.layout\n",  # planted: api past service
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert check(tmp_path) == [
        "api.cli imports parallel.layout: parallel is not below api",
        "parallel.planner imports workers.config: workers is not below parallel",
        "service.pool.group imports service.control.state: service.control is not below service.pool",
        "service.typed imports api.app: api is not below service",
        "import cycle among service.control.state, service.pool.group",
        "import cycle among workers.a, workers.b, workers.c",
        "import cycle among workers.d, workers.e",
    ]
    # the allow-list excuses exactly what it names
    assert check(tmp_path, frozenset({("api.cli", "parallel.layout"), ("workers.c", "workers.a"),
                                      ("parallel.planner", "workers.config"), ("service.typed", "api.app"),
                                      ("service.pool.group", "service.control.state"),
                                      ("workers.d", "workers.e")})) == []
