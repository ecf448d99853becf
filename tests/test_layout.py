"""The package's layout, computed from its source: no import cycle (imports inside functions
count), no private name imported from another module, and the layers that
docs/architecture.md draws hold (a module imports only its own folder or the layers below).
The process is the caller's: only command_line/exits.py and process/sigterm.py (and ``__main__``
blocks) end it, and only integration/registration.py changes fairseq's, torch's, hydra's or
OmegaConf's modules and classes. What lives beside the package in the checkout (benchmarks/,
recipes/, scripts/, tests/) is neither installed nor imported by it. Loading the plugin imports
no package that fairseq-train does not. Cheap: it parses the source and imports nothing."""
from __future__ import annotations

import ast
import fnmatch
import re
import sys
import tomllib
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


#: the modules that may end the process: the training commands' errors (one line and the exit
#: status, where the plugin owns the process) and the SIGTERM handler's exit
EXIT_OWNERS = {f"{PACKAGE}.command_line.exits", f"{PACKAGE}.process.sigterm"}
#: the one module that changes other libraries' modules and classes (the numbered patches)
PATCH_OWNER = f"{PACKAGE}.integration.registration"
PATCHED_LIBRARIES = ("fairseq", "fairseq_cli", "torch", "hydra", "omegaconf")
EXIT_CALLS = {"sys.exit", "os._exit", "os.abort", "exit", "quit"}


def _names_bound(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted module or object an import binds it to (any depth), and
    names assigned from such a dotted name (``utils = fairseq.distributed.utils``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                    a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            bound = _dotted(node.value, names)
            if bound:
                names[node.targets[0].id] = bound
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``a.b.c`` (or ``a.b[k].c``: the object indexed) as the dotted path ``a`` is bound to
    plus ``.b.c``; a bare name not bound by an import is itself (a builtin: ``exit``)."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([names.get(node.id, node.id)] + parts[::-1])


def _outside_main_blocks(tree: ast.AST):
    """Every node of ``tree`` except those inside ``if __name__ == "__main__":``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def exits(modules: dict[str, Path]) -> list[str]:
    """Where a module other than EXIT_OWNERS ends the process (outside ``__main__`` blocks):
    sys.exit, os._exit, os.abort, exit(), quit(), raise SystemExit."""
    found = []
    for name, path in modules.items():
        if name in EXIT_OWNERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = _names_bound(tree)
        for node in _outside_main_blocks(tree):
            what = None
            if isinstance(node, ast.Call) and _dotted(node.func, names) in EXIT_CALLS:
                what = _dotted(node.func, names)
            elif isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if _dotted(exc, names) in ("SystemExit", "builtins.SystemExit"):
                    what = "raise SystemExit"
            if what:
                found.append(f"{name}:{node.lineno}: {what}")
    return sorted(found)


def patches(modules: dict[str, Path]) -> list[str]:
    """Where a module other than PATCH_OWNER assigns an attribute (or an item of one) of a
    module, class or function of PATCHED_LIBRARIES, by assignment or setattr."""
    found = []
    for name, path in modules.items():
        if name == PATCH_OWNER:
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = _names_bound(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            flat = []
            while targets:
                t = targets.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    targets.extend(t.elts)
                elif isinstance(t, (ast.Attribute, ast.Subscript)):
                    flat.append(t)
            for t in flat:
                dotted = _dotted(t, names)
                if dotted and dotted.split(".")[0] in PATCHED_LIBRARIES:
                    found.append(f"{name}:{node.lineno}: {dotted}")
    return sorted(found)


def beside_the_package(top: Path) -> set[str]:
    """The names a module could import the checkout's other Python by: each top-level folder
    beside the package that holds Python (``benchmarks``, ``recipes``, ``scripts``, ``tests``)
    and each module in one (its scripts put their own folder on sys.path: ``finetune_nllb``,
    ``conftest``, ``launcher``); a standard library module's name means that module."""
    names = set()
    for folder in top.iterdir():
        if folder.is_dir() and folder.name != PACKAGE and not folder.name.startswith(".") \
                and any(folder.rglob("*.py")):
            names.add(folder.name)
            names.update(path.stem for path in folder.rglob("*.py") if path.stem != "__init__")
    return names - set(sys.stdlib_module_names)


def outside_imports(modules: dict[str, Path], outside: set[str]) -> list[str]:
    """Where a module of the package imports (at any depth) a module named in ``outside``."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                heads = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                heads = [node.module.split(".")[0]]
            else:
                continue
            found += [f"{name}:{node.lineno}: {head}" for head in heads if head in outside]
    return sorted(found)


#: what fairseq-train imports anyway: all that loading the plugin may import beyond the
#: standard library (it runs in every process of a run, and of the suite's ~500)
LOADED_WITH_FAIRSEQ = {"torch", "numpy", "fairseq", "fairseq_cli", "hydra", "omegaconf"}


def imported_at_load(modules: dict[str, Path]) -> dict[str, set[str]]:
    """What importing the package runs: the modules reached from its ``__init__`` through
    module-level import statements (not those inside functions or classes; a submodule's
    packages too), each with the other top-level packages it imports at module level."""
    found, todo = {}, [PACKAGE]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = modules[name]
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found[name] = set()
        nodes = list(ast.parse(path.read_text(), str(path)).body)
        while nodes:
            node = nodes.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                sources = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.ImportFrom):
                sources = [node.module]
            elif isinstance(node, ast.Import):
                sources = [a.name for a in node.names]
            else:  # an if, try or with at module level: its statements run too
                nodes += [n for f in ("body", "orelse", "finalbody", "handlers")
                          for n in getattr(node, f, None) or []]
                continue
            for source in sources:
                if source.split(".")[0] != PACKAGE:
                    found[name].add(source.split(".")[0])
                    continue
                names = [f"{source}.{a.name}" for a in getattr(node, "names", ())
                         if isinstance(node, ast.ImportFrom)]
                for target in [source] + [n for n in names if n in modules]:
                    parts = target.split(".")
                    todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)
                             if ".".join(parts[:i]) in modules]
    return found


def imports_beyond_fairseqs(modules: dict[str, Path]) -> list[str]:
    """Where loading the package imports a package that is neither the standard library's nor
    among LOADED_WITH_FAIRSEQ."""
    allowed = LOADED_WITH_FAIRSEQ | set(sys.stdlib_module_names) | {"__future__"}
    return sorted(f"{name} imports {head}" for name, heads in imported_at_load(modules).items()
                  for head in heads - allowed)


def installed_packages(top: Path) -> list[str]:
    """The packages pyproject.toml's setuptools configuration installs from ``top``: as
    setuptools' ``packages.find`` finds them, every folder with an ``__init__.py`` under one
    (a top-level one for the first), by its dotted name, where an ``include`` pattern matches."""
    find = tomllib.loads((top / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = []
    for init in sorted(top.rglob("__init__.py")):
        parts = init.parent.relative_to(top).parts
        if parts and all((top.joinpath(*parts[:i]) / "__init__.py").exists()
                         for i in range(1, len(parts) + 1)):
            name = ".".join(parts)
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in find["find"]["include"]):
                found.append(name)
    return found


def write_tree(root: Path, sources: dict[str, str]) -> None:
    """A made-up checkout for the checks' own tests: each relative path written with its
    text, its folders made."""
    for rel, text in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_only_the_command_line_owners_end_the_process():
    assert not exits(MODULES)


def test_only_registration_changes_other_libraries():
    assert not patches(MODULES)


def test_the_benchmarks_recipes_and_scripts_stay_outside_the_package():
    """benchmarks/ (and its rank processes' timers, which patch fairseq's Trainer), the NLLB
    recipe's driver, scripts/ and tests/ are not installed, and no module of the package imports
    them: a user's run never loads them."""
    outside = beside_the_package(REPO)
    assert {"benchmarks", "recipes", "scripts", "tests", "harness", "finetune_nllb"} <= outside
    assert not outside_imports(MODULES, outside)
    installed = installed_packages(REPO)
    assert PACKAGE in installed and all(p.split(".")[0] == PACKAGE for p in installed), installed


def test_loading_the_plugin_imports_no_package_fairseq_train_does_not():
    """--user-dir fairseq_fsdp2 is imported by every process of a run: what it imports beyond
    the standard library is what fairseq-train imports anyway (torch, numpy, fairseq, hydra,
    omegaconf); an optional package (SentencePiece with protobuf: 0.03 CPU-s in each process;
    transformers, safetensors, matplotlib) is imported by the code that uses it, when it runs."""
    assert not imports_beyond_fairseqs(MODULES)


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
    write_tree(tmp_path / PACKAGE, sources)
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


def test_the_load_check_follows_what_importing_the_package_runs(tmp_path):
    """On a made-up package: module-level imports are followed (relative, absolute, from a
    package, inside a module-level try), those inside functions and classes are not, nor are
    modules nothing imports at module level."""
    sources = {
        "__init__.py": "from . import a\n",
        "a.py": "import json\nimport torch.nn\nfrom .low import b\n"
                "def f():\n    import transformers\nclass C:\n    import matplotlib\n",
        "low/__init__.py": "",
        "low/b.py": "try:\n    import sentencepiece\nexcept ImportError:\n    pass\n"
                    "from fairseq_fsdp2 import c\n",
        "c.py": "from google.protobuf import message\n",
        "d.py": "import safetensors\n",
    }
    write_tree(tmp_path / PACKAGE, sources)
    modules = modules_under(tmp_path)
    loaded = imported_at_load(modules)
    assert sorted(loaded) == sorted(f"{PACKAGE}{m}" for m in ("", ".a", ".low", ".low.b", ".c"))
    assert imports_beyond_fairseqs(modules) == [f"{PACKAGE}.c imports google",
                                                f"{PACKAGE}.low.b imports sentencepiece"]


def test_the_process_checks_find_what_they_look_for(tmp_path):
    """On a made-up package: every way to exit and to patch another library is found, aliases
    followed; the owners, ``__main__`` blocks and the package's own objects are left alone."""
    sources = {
        "__init__.py": "",
        "a.py": "import sys, os\nfrom sys import exit as leave\n"
                "def f():\n    sys.exit(2)\n    os._exit(1)\n    leave(3)\n    exit()\n"
                "    quit()\n    raise SystemExit(2)\n    raise SystemExit\n"
                "def g():\n    raise ValueError('fine')\n"
                "if __name__ == '__main__':\n    sys.exit(f())\n",
        "command_line/__init__.py": "",
        "command_line/exits.py": "import sys\ndef stop():\n    sys.exit(2)\n",
        "b.py": "import fairseq.options\nimport torch.nn as nn\nfrom fairseq_cli import train\n"
                "from hydra import utils as hu\nimport argparse\n"
                "fairseq.options.parse_args_and_arch = None\n"
                "def f(model):\n    train.Trainer = object\n    nn.Module.x += 1\n"
                "    setattr(hu, 'y', 1)\n    cfg = fairseq.options.DistributedTrainingConfig\n"
                "    cfg.__annotations__['k'] = int\n    model.no_sync = None\n"
                "    argparse.ArgumentParser.z = 1\n    a, nn.functional.w = 1, 2\n",
        "integration/__init__.py": "",
        "integration/registration.py": "import fairseq.options\n"
                                       "fairseq.options.parse_args_and_arch = None\n",
    }
    write_tree(tmp_path / PACKAGE, sources)
    modules = modules_under(tmp_path)
    a, b = f"{PACKAGE}.a", f"{PACKAGE}.b"
    assert exits(modules) == sorted([
        f"{a}:4: sys.exit", f"{a}:5: os._exit", f"{a}:6: sys.exit", f"{a}:7: exit",
        f"{a}:8: quit", f"{a}:9: raise SystemExit", f"{a}:10: raise SystemExit"])
    assert patches(modules) == sorted([
        f"{b}:6: fairseq.options.parse_args_and_arch", f"{b}:8: fairseq_cli.train.Trainer",
        f"{b}:9: torch.nn.Module.x", f"{b}:10: hydra.utils.?",
        f"{b}:12: fairseq.options.DistributedTrainingConfig.__annotations__",
        f"{b}:15: torch.nn.functional.w"])


def test_the_outside_checks_find_what_they_look_for(tmp_path):
    """On a made-up checkout: imports of the benchmarks and of a script's module are found
    (inside a function too), the package's own and other libraries' are not; a package beside
    the plugin is installed only where pyproject.toml's include lets it."""
    sources = {
        f"{PACKAGE}/__init__.py": "",
        f"{PACKAGE}/a.py": "import os\ndef f():\n    from benchmarks.harness import launch\n",
        f"{PACKAGE}/b.py": "import torch, finetune_nllb\nfrom . import a\n",
        "benchmarks/__init__.py": "",
        "benchmarks/harness.py": "",
        "recipes/finetune_nllb.py": "",
        "docs/page.md": "",
        "pyproject.toml": '[tool.setuptools.packages.find]\ninclude = ["fairseq_fsdp2*"]\n',
    }
    write_tree(tmp_path, sources)
    outside = beside_the_package(tmp_path)
    assert outside == {"benchmarks", "harness", "recipes", "finetune_nllb"}
    assert outside_imports(modules_under(tmp_path), outside) == [
        f"{PACKAGE}.a:3: benchmarks", f"{PACKAGE}.b:1: finetune_nllb"]
    assert installed_packages(tmp_path) == [PACKAGE]
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.packages.find]\ninclude = ["*"]\n')
    assert sorted(installed_packages(tmp_path)) == ["benchmarks", PACKAGE]


#: the one folder that knows what a moment format is (its dtypes, its side keys, its names):
#: the step and the estimator ask its format objects (optimizer/moments/__init__.py)
MOMENTS_FOLDER = f"{PACKAGE}.optimizer.moments"
#: the dtypes a moment format stores (as torch names them)
MOMENT_DTYPES = {"torch.uint8", "torch.float16", "torch.half", "torch.bfloat16"}
#: the parts that name those dtypes for what is not a moment: the compute and reduce dtypes of
#: the precision flags, the 16-bit gradient shards and weights (local_shard_step's
#: SIXTEEN_BIT_GRADS, SIXTEEN_BIT_WEIGHTS), the estimator's parameters and activations by
#: precision
DTYPES_FOR_OTHER_THINGS = {f"{PACKAGE}.optimizer.mixed_precision",
                           f"{PACKAGE}.optimizer.local_shard_step",
                           f"{PACKAGE}.estimator.model_profile"}
#: where a dtype may not name a moment format's, nor a format be compared with a format's name:
#: the step and the estimator (elsewhere a format's name picks its flag: the benchmarks)
RULES_CHECKED = (f"{PACKAGE}.optimizer.", f"{PACKAGE}.estimator.")
#: names a moment format is held by, when compared with a format's name
FORMAT_HOLDERS = {"adam_stats", "stats", "moments", "moment_format"}
#: where the formats' names are (settings.py's rules take a name: below optimizer/, it cannot
#: ask the format; tests/test_moment_formats.py checks its rules agree with the formats)
SETTINGS = f"{PACKAGE}.settings"


def _in_moments(name: str) -> bool:
    return name == MOMENTS_FOLDER or name.startswith(MOMENTS_FOLDER + ".")


def side_key_tables(modules: dict[str, Path]) -> dict[str, set[str]]:
    """The side-key tables of the moments folder, from its source: name -> the state keys of a
    dict literal keyed by both moments (``SCALE_KEYS = {"exp_avg": "exp_avg_scale", ...}``)."""
    tables: dict[str, set[str]] = {}
    for name, path in modules.items():
        if not _in_moments(name):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                    len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
                values = [v.value for v in node.value.values if isinstance(v, ast.Constant)]
                if sorted(keys) == ["exp_avg", "exp_avg_sq"] and \
                        all(isinstance(v, str) for v in values) and len(values) == 2:
                    tables[node.targets[0].id] = set(values)
    return tables


def format_names(modules: dict[str, Path]) -> set[str]:
    """settings.MOMENT_FORMATS, from its source, but ``fp32`` (fairseq's own: comparing with it
    asks whether anything is stored otherwise, not how)."""
    tree = ast.parse(modules[SETTINGS].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MOMENT_FORMATS" for t in node.targets):
            return {e.value for e in node.value.elts} - {"fp32"}
    return set()


def _constants(node: ast.AST) -> set:
    if isinstance(node, ast.Constant):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def _holder(node: ast.AST) -> str | None:
    name = node.attr if isinstance(node, ast.Attribute) else \
        node.id if isinstance(node, ast.Name) else None
    return name if name in FORMAT_HOLDERS else None


def moment_format_bypasses(modules: dict[str, Path]) -> list[str]:
    """Where a module outside the moments folder knows what only a format should: a side key
    (anywhere: the string, or a side-key table imported); in the step and the estimator, a
    moment dtype named, or a format held by name compared with a format's name."""
    tables = side_key_tables(modules)
    keys = set().union(*tables.values()) if tables else set()
    names = format_names(modules)
    found = []
    for name, path in modules.items():
        if _in_moments(name):
            continue
        tree = ast.parse(path.read_text(), str(path))
        bound = _names_bound(tree)
        rules = name.startswith(RULES_CHECKED)
        dtypes = rules and name not in DTYPES_FOR_OTHER_THINGS
        for node in ast.walk(tree):
            if dtypes and isinstance(node, ast.Attribute) and \
                    _dotted(node, bound) in MOMENT_DTYPES:
                found.append(f"{name}:{node.lineno}: {_dotted(node, bound)}")
            elif isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{name}:{node.lineno}: {node.value!r}")
            elif isinstance(node, ast.ImportFrom) and \
                    any(a.name in tables for a in node.names):
                found.append(f"{name}:{node.lineno}: imports "
                             f"{', '.join(a.name for a in node.names if a.name in tables)}")
            elif isinstance(node, ast.Compare) and rules:
                sides = [node.left, *node.comparators]
                held = [h for h in map(_holder, sides) if h]
                named = set().union(*map(_constants, sides)) & names
                if held and named:
                    found.append(f"{name}:{node.lineno}: {held[0]} compared with "
                                 f"{', '.join(sorted(named))}")
    return sorted(found)


def test_only_the_moments_folder_knows_a_moment_format():
    assert side_key_tables(MODULES), "the moments folder's side-key tables are found"
    assert format_names(MODULES) >= {"fp16", "bf16", "8bit"}
    assert not moment_format_bypasses(MODULES)


def test_the_moment_format_check_finds_what_it_looks_for(tmp_path):
    """On a made-up package: a dtype compared in the step, a side key read by its string and
    through its imported table, a format's name compared in the estimator are found; the same
    inside the moments folder, a dtype of the precision flags, settings.py's rule and a
    benchmark's flag from a format's name are left alone."""
    sources = {
        "__init__.py": "",
        "settings.py": "MOMENT_FORMATS = ('fp32', 'fp16', '8bit')\n"
                       "def f(moments):\n    return moments != 'fp16'\n",
        "optimizer/__init__.py": "",
        "optimizer/moments/__init__.py": "",
        "optimizer/moments/eight_bit.py": "import torch\n"
                                          "ABSMAX_KEYS = {'exp_avg': 'exp_avg_absmax', "
                                          "'exp_avg_sq': 'exp_avg_sq_absmax'}\n"
                                          "SIGNED = {'exp_avg': True, 'exp_avg_sq': False}\n"
                                          "def f(v):\n    return v.dtype == torch.uint8\n",
        "optimizer/step.py": "import torch as t\nfrom .moments.eight_bit import ABSMAX_KEYS\n"
                             "def f(state, v):\n    if v.dtype == t.uint8:\n"
                             "        return state['exp_avg_sq_absmax']\n"
                             "    return v.to(t.float32)\n",
        "optimizer/mixed_precision.py": "import torch\nHALF = torch.float16\n",
        "benchmarks/__init__.py": "",
        "benchmarks/run.py": "def flags(stats):\n    return {'bf16': stats == 'fp16'}\n",
        "estimator/__init__.py": "",
        "estimator/ledger.py": "def f(setup):\n    return 2 if setup.adam_stats in ('fp16', "
                               "'bf16') else setup.adam_stats != 'fp32'\n",
    }
    write_tree(tmp_path / PACKAGE, sources)
    modules = modules_under(tmp_path)
    step, ledger = f"{PACKAGE}.optimizer.step", f"{PACKAGE}.estimator.ledger"
    assert side_key_tables(modules) == {"ABSMAX_KEYS": {"exp_avg_absmax", "exp_avg_sq_absmax"}}
    assert moment_format_bypasses(modules) == sorted([
        f"{step}:2: imports ABSMAX_KEYS", f"{step}:4: torch.uint8",
        f"{step}:5: 'exp_avg_sq_absmax'", f"{ledger}:2: adam_stats compared with fp16"])
