"""The package's layering holds: a module imports only from its own layer or the layers below it,
and no two modules import each other, directly or around a circle.

The layers are listed here and in docs/architecture.md ("Layers"), and a test checks that the two
lists agree. Every import counts, those inside functions too: a lazy import is still a
dependency. The checker itself is tested on the real package with a deliberate upward import and a
deliberate circle added, so that it cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptstore"

# Bottom to top. A module belongs to the layer of the longest prefix that names it.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["ckptstore._version", "ckptstore.errors", "ckptstore._faults", "ckptstore._gc",
                    "ckptstore._buffers", "ckptstore._units", "ckptstore._aio", "ckptstore.names"]),
    ("format", ["ckptstore.format"]),
    ("storage, planning, goodput, collective", ["ckptstore.storage", "ckptstore.planning", "ckptstore.goodput",
                                                "ckptstore.collective"]),
    ("checkpoint", ["ckptstore.checkpoint"]),
    ("state", ["ckptstore.train_state", "ckptstore.data"]),
    ("tiers", ["ckptstore.tiers"]),
    ("engine", ["ckptstore.engine"]),
    ("api", ["ckptstore.api"]),
    ("front", ["ckptstore", "ckptstore.dcp", "ckptstore.hf", "ckptstore.lightning", "ckptstore._adapters",
               "ckptstore.convert", "ckptstore.bench", "ckptstore.demo", "ckptstore.cli", "ckptstore.cli_docs",
               "ckptstore.testing", "ckptstore._local_s3"]),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, tuple[str, bool]]:
    """Every module of the package: name -> (source text, whether it is a package's __init__)."""
    return {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def imports(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Each module's imports of other modules of the package (every import statement, anywhere)."""
    out: dict[str, set[str]] = {}
    for name, (text, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "ckptstore"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "ckptstore":
                    continue
                # "from . import direct" names a module; "from .base import X" names X in a module.
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                found |= set(subs) if subs else {target}
        out[name] = {m for m in found if m != name}
    return out


def layer_of(module: str) -> int:
    best, found = -1, None
    for index, (_title, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS here and in docs/architecture.md")
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                  for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm)."""
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


def test_every_module_imports_only_its_own_layer_or_below():
    assert upward(imports(sources())) == []


def test_no_module_imports_another_that_imports_it_back():
    assert circles(imports(sources())) == []


def test_the_checker_sees_an_upward_import_and_a_circle():
    modules = sources()
    text, is_package = modules["ckptstore.format.checksum"]
    modules["ckptstore.format.checksum"] = (text + "\n\ndef _late():\n    from ..engine import store\n", is_package)
    found = upward(imports(modules))
    assert found == ["ckptstore.format.checksum (format) imports ckptstore.engine.store (engine)"]
    text, is_package = modules["ckptstore.errors"]
    modules["ckptstore.errors"] = (text + "\nfrom .names import MANIFEST\n", is_package)
    text, is_package = modules["ckptstore.names"]
    modules["ckptstore.names"] = (text + "\nfrom .errors import CheckpointError\n", is_package)
    assert ["ckptstore.errors", "ckptstore.names"] in circles(imports(modules))


def test_every_module_has_a_layer():
    for module in sources():
        layer_of(module)


def test_the_layers_here_are_the_layers_in_architecture_md():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers: .*? -->\n(.*?)\n<!-- /layers -->", text, re.S)
    assert block, "docs/architecture.md lost its layer table (between <!-- layers: ... --> and <!-- /layers -->)"
    rows = [line for line in block.group(1).splitlines() if line.startswith("|") and "`" in line]
    documented = [(re.sub(r"\*", "", r.split("|")[1]).strip(), re.findall(r"`([^`]+)`", r.split("|")[2]))
                  for r in rows]
    assert list(reversed(documented)) == LAYERS


ENGINE_AND_ADAPTERS = [m for m in sources() if m.startswith(("ckptstore.engine", "ckptstore.tiers"))
                       or m in ("ckptstore.dcp", "ckptstore.hf", "ckptstore.lightning")]


@pytest.mark.parametrize("module", ENGINE_AND_ADAPTERS)
def test_no_private_name_of_another_module_is_used(module):
    """Modules talk through each other's public names: a private name is its module's own. The
    adapters reach the store through its public methods only (restore(step=...), latest_step,
    all_gather, last_step), never through one of its attributes starting with "_"."""
    text, _ = sources()[module]
    private = [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
               for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []
    reaching_in = [f"{node.value.id}.{node.attr}" for node in ast.walk(ast.parse(text))
                   if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                   and not node.attr.startswith("__") and node.value.id in ("store", "tier", "pipeline")]
    assert reaching_in == []
