"""The package layout's rules (docs/architecture.md): no import cycle among stalwart's modules,
no import from a lower layer to a higher one, code that runs in a worker or a node agent
does not import the supervisor's, and no module of orchestrator/ outgrows one concept."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "health", "ckpt", "dashboards", "examples")
MAX_LINES = 600  # "one concept per module, well under ~600 lines"
MAX_ACTOR_LINES = 500  # the supervisor actor's class


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = ["stalwart", *path.relative_to(REPO).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports, anywhere in the file (functions and
    TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            # The longest prefix that is one of ours: `from a.b import c` names a.b.c if
            # that is a module, else a.b.
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def _offenders(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    def under(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return sorted(
        f"{a} imports {b}"
        for a, deps in GRAPH.items()
        if under(a, sources)
        for b in deps
        if under(b, forbidden)
    )


def test_the_walk_found_the_packages():
    assert "stalwart.orchestrator.supervisor.actor" in GRAPH
    assert (
        "stalwart.orchestrator.supervisor.pool" in GRAPH["stalwart.orchestrator.supervisor.actor"]
    )
    assert "stalwart.ckpt.holdings" in GRAPH["stalwart.orchestrator.supervisor.checkpoints"]


def test_no_import_cycle():
    assert _cycles() == []


def test_libraries_never_import_the_orchestrator():
    libraries = ("stalwart.health", "stalwart.ckpt", "stalwart.dashboards")
    assert _offenders(libraries, ("stalwart.orchestrator",)) == []


def test_worker_and_agent_code_never_imports_the_supervisor():
    # What runs in a rank's or a node agent's process stays out of the supervisor's modules
    # (and so never drags them into those processes).
    sources = (
        "stalwart.orchestrator.worker",
        "stalwart.orchestrator.agent",
        "stalwart.orchestrator.chaos.actions",
    )
    assert (
        _offenders(sources, ("stalwart.orchestrator.supervisor", "stalwart.orchestrator.driver"))
        == []
    )


def test_collaborators_are_called_only_from_above():
    # Nothing below the actor imports it; detection, checkpoints and the ledger never reach
    # up into recovery or elastic resizing.
    collaborators = tuple(
        n
        for n in GRAPH
        if n.startswith("stalwart.orchestrator.supervisor.") and not n.endswith(".actor")
    )
    assert _offenders(collaborators, ("stalwart.orchestrator.supervisor.actor",)) == []
    below = (
        "stalwart.orchestrator.supervisor.detect",
        "stalwart.orchestrator.supervisor.checkpoints",
        "stalwart.orchestrator.supervisor.ledger",
        "stalwart.orchestrator.supervisor.generation",
        "stalwart.orchestrator.supervisor.pool",
    )
    above = (
        "stalwart.orchestrator.supervisor.recovery",
        "stalwart.orchestrator.supervisor.elastic",
    )
    assert _offenders(below, above) == []


def test_no_orchestrator_module_outgrows_one_concept():
    long = {
        str(p.relative_to(REPO)): n
        for name, p in MODULES.items()
        if name.startswith("stalwart.orchestrator")
        and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_supervisor_actor_stays_small():
    path = MODULES["stalwart.orchestrator.supervisor.actor"]
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "JobSupervisor"]
    assert cls.end_lineno - cls.lineno + 1 <= MAX_ACTOR_LINES
