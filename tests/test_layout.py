"""The package's layout, computed from its source: no import cycle (imports inside functions
count), no private name imported from another module, and the layers that
docs/architecture.md draws hold (a module imports only its own folder or the layers below).
Cheap: it parses the source and imports nothing."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = "fairseq_fsdp2"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def modules_under(top: Path) -> dict[str, Path]:
    """Module name -> file, for the package in ``top`` (the folder holding ``fairseq_fsdp2``)."""
    found = {}
    for path in sorted((top / PACKAGE).rglob("*.py")):
        parts = path.relative_to(top).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules_under(REPO)


def imports_of(name: str, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module of the package it imports, the name taken from it or None) for every import
    statement of module ``name``, at any depth (inside functions too)."""
    path = modules[name]
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, None) if submodule in modules else (source, alias.name))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {target for target, _ in imports_of(name, modules) if target != name}
            for name in modules}


def cycles_in(edges: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def private_imports(modules: dict[str, Path]) -> list[str]:
    return sorted(f"{name} imports {attr} from {source}" for name in modules
                  for source, attr in imports_of(name, modules)
                  if attr is not None and attr.startswith("_") and source != name)


def part_of(name: str, modules: dict[str, Path]) -> str:
    """The folder (``sharding/``) or top-level module (``errors.py``) a module belongs to."""
    rest = name.split(".")[1:]
    if not rest:
        return "__init__.py"
    nested = len(rest) > 1 or modules[name].name == "__init__.py"
    return f"{rest[0]}/" if nested else f"{rest[0]}.py"


def upward_imports(modules: dict[str, Path], layers: list[list[str]]) -> list[str]:
    """Imports of another part of the same layer or of a layer above."""
    level = {part: i for i, layer in enumerate(layers) for part in layer}
    found = []
    for name, targets in import_graph(modules).items():
        here = part_of(name, modules)
        for target in targets:
            there = part_of(target, modules)
            if there != here and level[there] >= level[here]:
                found.append(f"{name} ({here}, layer {level[here] + 1}) imports {target} "
                             f"({there}, layer {level[there] + 1})")
    return sorted(found)


def documented_layers() -> list[list[str]]:
    """The layers of docs/architecture.md's table (after ``<!-- layers -->``), bottom first:
    each a list of folders (``sharding/``) and top-level modules (``errors.py``)."""
    table = ARCHITECTURE.read_text().split("<!-- layers -->")[1]
    rows = [line.split("|") for line in table.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [int(r[1]) for r in rows] == list(range(1, len(rows) + 1)), "layers numbered 1, 2, ..."
    return [re.findall(r"`([a-z_0-9]+(?:/|\.py))`", r[2]) for r in rows]


def test_every_import_names_a_module_of_the_package():
    unknown = sorted({(name, target) for name in MODULES
                      for target, _ in imports_of(name, MODULES) if target not in MODULES})
    assert not unknown


def test_no_import_cycle():
    cycles = cycles_in(import_graph(MODULES))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_name_imported_from_another_module():
    assert not private_imports(MODULES)


def test_the_architecture_page_names_every_part_of_the_package_once():
    named = [part for layer in documented_layers() for part in layer]
    assert sorted(named) == sorted({part_of(name, MODULES) for name in MODULES})


def test_imports_point_down_the_layers():
    assert not upward_imports(MODULES, documented_layers())


def test_the_checks_find_what_they_look_for(tmp_path):
    """On a made-up package with a cycle (through an import inside a function), a private
    import and imports that point up or sideways, each check finds exactly those."""
    sources = {
        "__init__.py": "",
        "errors.py": "",
        "low/__init__.py": "",
        "low/a.py": "from ..high import b\nfrom .c import _hidden\nfrom ..errors import E\n",
        "low/c.py": "def f():\n    from . import a\n",
        "side/__init__.py": "",
        "side/d.py": "import fairseq_fsdp2.low.c\n",
        "high/__init__.py": "",
        "high/b.py": "from fairseq_fsdp2.low import a\n",
    }
    for rel, text in sources.items():
        (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / rel).write_text(text)
    modules = modules_under(tmp_path)
    a, b, c = f"{PACKAGE}.low.a", f"{PACKAGE}.high.b", f"{PACKAGE}.low.c"
    edges = import_graph(modules)
    assert edges[a] == {b, c, f"{PACKAGE}.errors"} and edges[c] == {a}
    assert sorted(sorted(set(cycle)) for cycle in cycles_in(edges)) == [[b, a], [a, c]]
    assert private_imports(modules) == [f"{a} imports _hidden from {c}"]
    layers = [["errors.py"], ["low/", "side/"], ["high/"], ["__init__.py"]]
    assert upward_imports(modules, layers) == [
        f"{a} (low/, layer 2) imports {b} (high/, layer 3)",
        f"{PACKAGE}.side.d (side/, layer 2) imports {c} (low/, layer 2)"]
