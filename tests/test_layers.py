"""The package's layers: data flows down only, and no module imports itself back through others.

Every import in ``src/edgetrain`` (module level, inside functions and under ``TYPE_CHECKING`` alike) is
read from the source. A module may import modules of its own layer's package or of a lower layer, never
a higher one (see ``LAYERS``); the import graph has no cycle. Planting ``from ..api import prepare`` in
``planners/dp.py`` makes both tests fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import edgetrain

SRC = Path(edgetrain.__file__).resolve().parent
ROOT = "edgetrain"

#: layer of each top-level module or package, lowest first; surfaces (the step API, Trainer, CLI, report,
#: Flower apps, model and data specs) sit on top of everything else
LAYERS: dict[str, int] = {
    # shared leaf types
    "units": 0, "errors": 0, "settings": 0, "graph": 0, "plan": 0, "devices": 0, "batch": 0, "config": 0,
    "_state": 0, "native": 0, "forking": 0, "losses": 0,
    "capture": 1, "planners": 1,
    "runtime": 2,
    "profile": 3,
    "planning": 4,
    "adaptation": 5, "approx": 5,
}
SURFACE = 6


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in SRC.rglob("*.py"):
        name, is_pkg = _module_name(p)
        out[name] = (p, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the edgetrain modules it imports (a name imported from a package counts as the package,
    unless the name is a submodule)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    targets.append(sub if sub in mods else mod)
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != name and t.split(".")[0] == ROOT:
                    graph[name].add(t)
    return graph


def layer(module: str) -> tuple[int, str]:
    """(layer, top-level package) of a module; the package root's ``__init__`` is a surface."""
    parts = module.split(".")
    if len(parts) == 1:
        return SURFACE, ""
    return LAYERS.get(parts[1], SURFACE), parts[1]


def back_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        lsrc, psrc = layer(src)
        for t in sorted(targets):
            lt, pt = layer(t)
            if lt > lsrc or (lt == lsrc and lsrc not in (0, SURFACE) and pt != psrc):
                bad.append(f"{src} (layer {lsrc}) imports {t} (layer {lt})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_climbs_back_up_a_layer():
    assert back_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_top_level_name_has_a_layer_or_is_a_surface():
    surfaces = {"api", "step", "verify", "offline", "measure", "checkpoint", "data", "models", "trainer", "cli",
                "report", "fl", "spec", "adapt", "profiles", "__init__"}
    names = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__"))}
    assert names - set(LAYERS) <= surfaces, names - set(LAYERS) - surfaces


def test_a_planted_back_import_is_caught():
    graph = import_graph()
    graph["edgetrain.planners.dp"] = graph["edgetrain.planners.dp"] | {"edgetrain.api"}
    assert any("edgetrain.planners.dp (layer 1) imports edgetrain.api" in b for b in back_imports(graph))
    assert cycles(graph)  # api reaches the planners, so the planted edge closes a loop
