"""The package's layers, written once, and every import read from the source against them.

A module may import modules of its own layer or of a lower one, never a higher one, and no
two modules may import each other, however indirectly. Every import counts: at the top of a
module, inside a function (a lazy import is still a dependency) and under ``TYPE_CHECKING``.
A failure names the file and line of each offending import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # leaves: name tables and small helpers that import nothing above them
    (
        "leaves",
        (
            "digen.errors",
            "digen.checkpoint",
            "digen.seeding",
            "digen.prompts",
            "digen.data",
            "digen.shapes",  # the shapes world: numpy only
            "digen.registry",  # what digen ships, by name
            "digen.quiet",  # what the libraries may print, kept quiet
        ),
    ),
    ("sched", ("digen.sched",)),  # the schedule's core: torch-free, knows no config
    ("planning", ("digen.planning",)),  # layouts ranked on the core's simulator, torch-free
    ("config", ("digen.presets", "digen.config")),
    ("models", ("digen.models",)),  # one backbone a file, single-device code
    ("algos", ("digen.algos",)),  # the RL math
    ("rewards", ("digen.rewards",)),  # scoring samples: built-ins, hooks, HTTP client, server
    # the processes. Shared by every process: the messages between them, placement, notes, the
    # metrics row; then how processes start and reach each other
    ("runtime", ("digen.runtime",)),
    ("transport", ("digen.runtime.transport",)),
    ("worker", ("digen.runtime.worker", "digen.runtime.colocated")),  # the actors; colocated
    ("driver", ("digen.runtime.driver",)),  # the driver process's loop and its book-keeping
    ("run", ("digen.run", "digen")),  # the user-facing side: runner, its I/O, bench
    # (``digen`` is the package's own __init__, its public names: it matches no submodule)
    ("cli", ("cli",)),
)
"""Bottom to top: a module belongs to the layer of its longest matching prefix."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*(ROOT / "digen").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]
    return {_module_name(p): p for p in sorted(files)}


def _layer(module: str) -> int:
    best, where = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            below = module.startswith(prefix + ".") and prefix != "digen"
            if (module == prefix or below) and len(prefix) > best:
                best, where = len(prefix), i
    return where


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import of the package's own modules."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from digen.sched import plan` imports the module digen.sched.plan
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import digen.sched.plan.X` -> its module
                name = name.rpartition(".")[0]
            if name and name != module:
                out.append((name, node.lineno))
    return out


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    sources = _sources()
    known = set(sources)
    return sources, {m: _imports(m, p, known) for m, p in sources.items()}


def _cycles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    sources, _ = _graph()
    missing = [m for m in sources if _layer(m) < 0]
    assert not missing, f"add these modules to LAYERS in {Path(__file__).name}: {missing}"


def test_no_import_runs_up_the_layers() -> None:
    sources, edges = _graph()
    upward = [
        f"{sources[m].relative_to(ROOT)}:{line}: {m} ({LAYERS[_layer(m)][0]}) imports "
        f"{target} ({LAYERS[_layer(target)][0]}), a higher layer"
        for m, targets in edges.items()
        for target, line in targets
        if _layer(target) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_two_modules_import_each_other() -> None:
    sources, edges = _graph()
    problems = []
    for component in _cycles(edges):
        members = set(component)
        problems.append("a cycle between " + ", ".join(component) + ":")
        problems += [
            f"  {sources[m].relative_to(ROOT)}:{line}: {m} imports {target}"
            for m in component
            for target, line in edges[m]
            if target in members
        ]
    assert not problems, "\n".join(problems)


def test_the_reader_sees_what_it_should() -> None:
    """The checks above are only as good as the import reader: try it on known imports."""
    sources, edges = _graph()
    config = dict(edges["digen.config"])
    assert "digen.sched.plan" in config and "digen.errors" in config
    assert ("digen.config", 1) not in edges["digen.config"]
    driver = {t for t, _ in edges["digen.runtime.driver.loop"]}
    assert "digen.sched.scheduler" in driver and "digen.config" in driver
    # a made-up cycle and an upward import are caught
    fake = {"a": [("b", 1)], "b": [("c", 2)], "c": [("a", 3)], "d": [("a", 4)]}
    assert _cycles(fake) == [["a", "b", "c"]]
    assert _layer("digen.sched.plan") < _layer("digen.config") < _layer("digen.runtime.driver")
