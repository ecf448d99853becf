"""Every private torch name the package uses, probed: each is imported or looked up on a real
object and its shape checked (the signature's parameters the package passes, the attributes it
reads or writes), so that a torch upgrade that moves one fails here in seconds with the list of
all that moved, not at the first 2-rank run that reaches one. The two checks that keep the list
true:

- ``test_the_private_torch_names_are_where_the_package_expects_them``: every entry of ``PROBED``
  resolved and checked; all failures collected, then reported together.
- ``test_every_private_torch_use_of_the_package_is_probed``: an AST scan of ``fairseq_fsdp2/``
  finds every private torch use (below); the scan's set must equal ``PROBED``'s keys plus the
  private names of other libraries (``NOT_TORCH``), so a new use fails until it is probed.

What the scan finds (``private_uses``):
- imports of or from a torch module with a private part (``from torch._guards import x``:
  ``torch._guards.x``);
- attribute chains on a torch module that reach a private name (``torch.ops.c10d._x_.default``:
  ``torch.ops.c10d._x_``), imports inside functions and aliases (``import torch.nn as nn``)
  followed;
- dotted torch module paths in string constants (a warning filter's module regex);
- private attributes of other objects (``unit._get_fsdp_state()``: ``._get_fsdp_state``, also
  through ``getattr``/``hasattr``/``setattr`` with a constant name) that the package does not
  define itself (as a function, class or ``self.`` attribute);
- in a class of the package derived from a torch class, every private name it defines or uses
  on ``self`` that the torch class also has (an override or a use of its internals:
  ``MemTracker._update_snap``), keyed ``torch.<module>.<Class>.<name>``.

What it cannot see: public-looking names on private torch classes (``post_forward_mesh_info`` on
an FSDP2 parameter group); ``PROBED``'s checks name those beside the private attribute that
reaches the object. Imports only torch (no fairseq); FSDP2's state is read on a one-rank unit in
a fake process group, destroyed again. A few seconds, most of it importing
``torch.distributed._tools`` (TorchDynamo).
"""
from __future__ import annotations

import ast
import enum
import importlib
import inspect
import pkgutil
import re
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Optional

import pytest
import torch

from conftest import REPO

PACKAGE = "fairseq_fsdp2"


# -- the scan ----------------------------------------------------------------------------------

def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted module or object it is bound to by an import (any depth)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    root = a.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> Optional[list[str]]:
    """``a.b.c`` as ``[<what a is bound to>, "b", "c"]`` when ``a`` is an imported name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return aliases[node.id].split(".") + parts[::-1]
    return None


def _torch_key(parts: list[str]) -> Optional[str]:
    """The torch path up to its last private part, or None (not torch, or nothing private)."""
    if parts[0] != "torch":
        return None
    last = max((i for i, p in enumerate(parts) if _private(p)), default=None)
    return None if last is None else ".".join(parts[:last + 1])


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            found.add(id(node.body[0].value))
    return found


def _torch_bases(cls: ast.ClassDef, aliases: dict[str, str]) -> list[str]:
    bases = [_dotted(b, aliases) for b in cls.bases]
    return [".".join(b) for b in bases if b and b[0] == "torch"]


def _own_names(trees: Iterable[ast.AST]) -> set[str]:
    """Private names the package defines: functions, classes, ``self.``/``cls.`` attributes
    and names it assigns."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    return {n for n in own if _private(n)}


def _attribute_uses(node: ast.AST) -> Iterable[tuple[ast.AST, str]]:
    """(object, private attribute name) for ``obj._x`` and ``getattr(obj, "_x")`` alike."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        yield node.value, node.attr
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
            isinstance(node.args[1].value, str) and _private(node.args[1].value):
        yield node.args[0], node.args[1].value


def _torch_class_private_names(base: str) -> set[str]:
    """Private names a torch class has: class attributes and the ``self._x`` its classes'
    source assigns (instance attributes). Imports the class."""
    module, _, name = base.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    found = {n for n in dir(cls) if _private(n)}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "torch":
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            found |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=[^=]", source))
    return found


def private_uses(top: Path) -> dict[str, set[str]]:
    """Private torch uses of the package in ``top`` (the folder holding ``fairseq_fsdp2``):
    key (see the module's docstring) -> the places (``file:line``)."""
    files = sorted((top / PACKAGE).rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    own = _own_names(trees.values())
    uses: dict[str, set[str]] = {}

    def add(key: str, path: Path, node: ast.AST) -> None:
        uses.setdefault(key, set()).add(f"{path.relative_to(top)}:{node.lineno}")

    for path, tree in trees.items():
        aliases = _aliases(tree)
        docstrings = _docstrings(tree)
        in_torch_subclass: set[int] = set()
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            bases = _torch_bases(cls, aliases)
            if not bases:
                continue
            names = {}
            for node in ast.walk(cls):
                in_torch_subclass.add(id(node))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        _private(node.name) and node in cls.body:
                    names.setdefault(node.name, node)
                for obj, attr in _attribute_uses(node):
                    if isinstance(obj, ast.Name) and obj.id == "self":
                        names.setdefault(attr, node)
            for base in bases:
                theirs = _torch_class_private_names(base)
                for name, node in names.items():
                    if name in theirs:
                        add(f"{base}.{name}", path, node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    key = _torch_key(a.name.split("."))
                    if key:
                        add(key, path, node)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                for a in node.names:
                    if _torch_key(f"{node.module}.{a.name}".split(".")):
                        add(f"{node.module}.{a.name}", path, node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    id(node) not in docstrings:
                for found in re.findall(r"torch(?:\.\w+)+", node.value.replace("\\.", ".")):
                    key = _torch_key(found.split("."))
                    if key:
                        add(key, path, node)
            for obj, attr in _attribute_uses(node):
                chain = _dotted(obj, aliases)
                if chain is not None:  # on an imported module or object: torch's, or ignored
                    key = _torch_key(chain + [attr])
                    if key:
                        add(key, path, node)
                elif attr not in own and not (id(node) in in_torch_subclass and
                                              isinstance(obj, ast.Name) and obj.id == "self"):
                    add(f".{attr}", path, node)
    return uses


# -- the probes --------------------------------------------------------------------------------

#: the object at a dotted path: its modules imported, then attributes (ImportError where the
#: first module is missing, AttributeError where a later name is)
resolve = pkgutil.resolve_name


def resolve_member(dotted: str):
    """``resolve``, where an instance attribute of a torch class (``MemTracker._WINFO``,
    assigned in its ``__init__``) counts as found: None for those."""
    try:
        return resolve(dotted)
    except AttributeError:
        parent, _, name = dotted.rpartition(".")
        if not inspect.isclass(resolve(parent)) or \
                name not in _torch_class_private_names(parent):
            raise
        return None


def parameters(*names: str) -> Callable[[object], None]:
    """A check: the callable's first parameters are ``names``, in this order (the package
    passes them positionally), and it takes no other required one."""
    def check(fn) -> None:
        params = list(inspect.signature(fn).parameters.values())
        got = [p.name for p in params[:len(names)]]
        assert got == list(names), f"parameters {got}, the package passes {list(names)}"
        required = [p.name for p in params[len(names):] if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        assert not required, f"new required parameters {required}"
    return check


def callable_(fn) -> None:
    assert callable(fn), f"{fn!r} is not callable"


def subclass_of(base) -> Callable[[object], None]:
    def check(cls) -> None:
        assert inspect.isclass(cls) and issubclass(cls, base), f"{cls!r} is no {base.__name__}"
    return check


def members(*names: str) -> Callable[[object], None]:
    def check(enum_cls) -> None:
        missing = [n for n in names if n not in enum_cls.__members__]
        assert not missing, f"no members {missing}"
    return check


def op_with_default(packet) -> None:
    assert hasattr(packet, "default"), f"{packet!r} has no .default overload"


def source_says(text: str) -> Callable[[object], None]:
    def check(module) -> None:
        assert text in inspect.getsource(module), f"{module.__name__} no longer says {text!r}"
    return check


def on_fsdp2(check_state: Callable[[object, object, object], None]) -> Callable[[], None]:
    """A check of FSDP2's private state on a real unit: ``fully_shard`` of a tiny linear
    module on a one-device mesh, no process group (``check_state(unit, state, group)``)."""
    def check() -> None:
        check_state(*_fsdp2_unit())
    return check


_unit_cache: list = []


def _fsdp2_unit():
    if not _unit_cache:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
        import torch.distributed as dist
        owned = not dist.is_initialized()
        if owned:  # a fake one-rank group: no store, no thread, destroyed again below
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            unit = fully_shard(torch.nn.Linear(2, 2), mesh=mesh)
            unit(torch.zeros(1, 2))  # FSDP2 sets some of its state at the first forward
            state = unit._get_fsdp_state()
            _unit_cache.append((unit, state, state._fsdp_param_groups[0]))
        finally:
            if owned:
                dist.destroy_process_group()
    return _unit_cache[0]


def has(obj, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    assert not missing, f"{type(obj).__name__} has no {missing}"


def _fsdp_state(unit, state, group) -> None:
    """units.all_unsharded, sixteen_bit_grads.param_groups, tracker: the state's groups and
    reshard setting (read and restored); tied_grad_reduce, narrow_grads: a group's settings."""
    assert isinstance(state._fsdp_param_groups, list) and state._fsdp_param_group is group
    assert isinstance(state._auto_reshard_after_forward, (bool, type(None)))
    has(group, "_orig_dtype", "post_forward_mesh_info", "fsdp_params", "mp_policy",
        "gradient_divide_factor", "force_sum_reduction_for_comms")
    assert group._orig_dtype == torch.float32, group._orig_dtype
    fsdp_param = group.fsdp_params[0]
    has(fsdp_param, "sharded_param", "all_gather_outputs")
    has(fsdp_param.sharded_param, "grad_dtype")


def _torch_lock_is_named(name: str) -> None:
    """kernels.TORCH_LOCK: torch's JIT build waits on a FileBaton of this name in the build
    folder (a string the scan cannot see)."""
    from torch.utils import cpp_extension
    source = inspect.getsource(cpp_extension._jit_compile)
    assert f"FileBaton(os.path.join(build_directory, '{name}'))" in source, \
        f"torch's JIT build no longer locks build_directory/{name}"


def _pg_timeouts() -> None:
    """heartbeat.set_collective_timeout on a one-rank gloo group: each backend of the group
    (``_device_types``, ``_get_backend``) reports its timeout in ``options._timeout``, which
    ``_set_pg_timeout`` changes and ``_set_default_timeout`` puts back."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=123))
    try:
        group = dist.group.WORLD
        backends = {id(b): b for b in (group._get_backend(d) for d in group._device_types)}
        before = {k: b.options._timeout for k, b in backends.items()}
        _set_pg_timeout(timedelta(seconds=7), group)
        assert all(b.options._timeout == timedelta(seconds=7) for b in backends.values()), \
            "options._timeout does not show _set_pg_timeout's value"
        for k, b in backends.items():
            b._set_default_timeout(before[k])
        assert {k: b.options._timeout for k, b in backends.items()} == before
        assert not owned or set(before.values()) == {timedelta(seconds=123)}, before
    finally:
        if owned:
            dist.destroy_process_group()


MEM_TRACKER = "torch.distributed._tools.mem_tracker.MemTracker"
FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"

#: key (as ``private_uses`` names it) -> where the package uses it, and a check of what it needs
#: beyond the name resolving (None: resolving is the check; a key that starts with "." is an
#: attribute of an object, checked by its function alone)
PROBED: dict[str, tuple[str, Optional[Callable]]] = {
    # sharding/
    f"{FSDP_COLLECTIVES}._get_gradient_divide_factors": (
        "tied_grad_reduce.py: the divisors of FSDP2's reduce-scatter, computed by FSDP2's rule",
        parameters("reduce_scatter_group", "all_reduce_group", "reduce_dtype", "device_type",
                   "factor", "force_sum_reduction_for_comms")),
    "._get_fsdp_state": ("units.py, sixteen_bit_grads.py, memory/tracker.py: a unit's state",
                         on_fsdp2(lambda unit, state, group: callable_(unit._get_fsdp_state))),
    "._fsdp_param_groups": ("units.py, sixteen_bit_grads.py", on_fsdp2(_fsdp_state)),
    "._fsdp_param_group": ("memory/tracker.py: a unit's one group", on_fsdp2(_fsdp_state)),
    "._auto_reshard_after_forward": ("units.all_unsharded: read, then restored",
                                     on_fsdp2(_fsdp_state)),
    "._orig_dtype": ("sixteen_bit_grads.py (written), tied_grad_reduce.py (read)",
                     on_fsdp2(_fsdp_state)),
    "torch.distributed.fsdp._fully_shard._fsdp_state": (
        "process/quiet.py: the module whose view-tensor warning a run silences",
        source_says("returned a view tensor")),
    # process/
    "torch.distributed.distributed_c10d._get_default_store": (
        "heartbeat.start: the default group's store", parameters()),
    "torch.distributed.distributed_c10d._set_pg_timeout": (
        "heartbeat.set_collective_timeout", parameters("timeout", "group")),
    "._device_types": ("heartbeat.set_collective_timeout: a group's backends", _pg_timeouts),
    "._get_backend": ("heartbeat.set_collective_timeout: a group's backends", _pg_timeouts),
    "._timeout": ("heartbeat.set_collective_timeout: a backend's timeout, to restore",
                  _pg_timeouts),
    "._set_default_timeout": ("heartbeat.set_collective_timeout: restored at the run's end",
                              _pg_timeouts),
    # estimator/
    "torch.utils._python_dispatch.TorchDispatchMode": (
        "model_profile.py: the meta-tensor answers", lambda cls: has(cls, "__torch_dispatch__")),
    "torch.ops.aten._local_scalar_dense": ("model_profile.py", op_with_default),
    "._cdata": ("model_profile.py: a storage's identity",
                lambda: has(torch.empty(1).untyped_storage(), "_cdata")),
    "._parameters": ("memory/tracker.py, sharding/plan.py: a module's own parameters",
                     lambda: has(torch.nn.Linear(1, 1), "_parameters")),
    "._non_persistent_buffers_set": ("sharding/meta_build.py",
                                     lambda: has(torch.nn.Linear(1, 1),
                                                 "_non_persistent_buffers_set")),
    # optimizer/
    "torch._foreach_mul_": ("local_shard_step.py: the clip's scaling", callable_),
    "torch.utils.cpp_extension._get_build_directory": (
        "kernels.py: the build's folder, where a killed build's lock file is found",
        lambda fn: (parameters("name", "verbose")(fn), _torch_lock_is_named("lock"))),
    # memory/tracker.py (imported only for --fsdp2-memory-breakdown)
    "torch._guards.active_fake_mode": ("memory/tracker.py", parameters()),
    "torch.distributed._tools.common_utils.get_untyped_storages": ("memory/tracker.py",
                                                                    parameters("t")),
    "torch.distributed._tools.mem_tracker._RefType": (
        "memory/tracker.py: Category derives from it", subclass_of(enum.Enum)),
    "torch.distributed._tools.mem_tracker._UpdateType": (
        "memory/tracker.py: _update_snap's kinds", members("ADD", "DEL", "SIZE", "REF")),
    f"{MEM_TRACKER}": ("memory/tracker.py: BreakdownTracker derives from it", None),
    "torch.utils._pytree.tree_flatten": ("memory/tracker.py", callable_),
    "torch.utils._pytree.tree_map_only": ("memory/tracker.py", callable_),
    "torch.ops.c10d._reduce_scatter_base_": ("memory/tracker.py", op_with_default),
    f"{MEM_TRACKER}._ref_class": ("BreakdownTracker: its categories", None),
    f"{MEM_TRACKER}._WINFO": ("BreakdownTracker: the weak references, cleared at exit", None),
    f"{MEM_TRACKER}._mod_tracker": ("BreakdownTracker: is_bw",
                                    lambda _: has(resolve("torch.distributed._tools.mod_tracker."
                                                          "ModTracker"), "is_bw")),
    f"{MEM_TRACKER}._in_opt": ("BreakdownTracker: in the optimizer step", None),
    f"{MEM_TRACKER}._curr_mem_snap": ("BreakdownTracker: the current snapshot", None),
    f"{MEM_TRACKER}._update_and_maybe_create_winfos": (
        "BreakdownTracker: tags a tensor", parameters("self", "t", "reftype")),
    f"{MEM_TRACKER}._track": ("BreakdownTracker: tags an op's output",
                              parameters("self", "reftype", "t")),
    f"{MEM_TRACKER}._track_optimizer_states": (
        "BreakdownTracker: overridden", parameters("self", "reftype", "optimizer")),
    f"{MEM_TRACKER}._update_snap": (
        "BreakdownTracker: overridden",
        parameters("self", "u_type", "winfo", "old_mem_consumed", "old_reftype")),
    f"{MEM_TRACKER}._pre_fw_hook": ("BreakdownTracker: overridden",
                                    parameters("self", "module", "inputs")),
    f"{MEM_TRACKER}._post_fw_hook": ("BreakdownTracker: overridden",
                                     parameters("self", "module", "inputs", "outputs")),
    f"{MEM_TRACKER}._pre_bw_hook": ("BreakdownTracker: overridden",
                                    parameters("self", "module", "args")),
    f"{MEM_TRACKER}._post_bw_hook": ("BreakdownTracker: overridden",
                                     parameters("self", "module", "args")),
}

#: private names of other libraries the scan cannot tell from torch's (an attribute of an object
#: it cannot type) -> whose they are
NOT_TORCH = {
    "._actions": "argparse.ArgumentParser (integration/hydra_config.py)",
    "._get_value": "argparse.ArgumentParser (integration/hydra_config.py)",
    "._get_values": "argparse.ArgumentParser (integration/hydra_config.py)",
    "._get_options": "fairseq.optim.adafactor.Adafactor (optimizer/adafactor_state.py)",
    "._fields": "a namedtuple's (checkpoint/safe_load.py)",
    "._reconstruct": "numpy's multiarray module (checkpoint/safe_load.py)",
    "._sync_stats": "fairseq.trainer.Trainer, whose sample-size sum the step in backward makes "
                    "as train_step does (trainer/fsdp2_trainer.py)",
    "._wrap_value_and_set": "omegaconf.DictConfig, building fairseq's hydra schema's "
                            "distributed_training node (integration/registration.py; its result "
                            "is checked in tests/test_options.py)",
}


def test_the_private_torch_names_are_where_the_package_expects_them():
    moved = []
    for key, (where, check) in PROBED.items():
        try:
            if key.startswith("."):
                check()
            else:
                obj = resolve_member(key)
                if check is not None:
                    check(obj)
        except Exception as e:  # noqa: BLE001 - every failure is collected, then reported
            moved.append(f"{key} ({where}): {type(e).__name__}: {e}")
    assert not moved, f"torch {torch.__version__}: {len(moved)} private name(s) moved:\n" + \
        "\n".join(moved)


def test_every_private_torch_use_of_the_package_is_probed():
    uses = private_uses(REPO)
    unprobed = sorted(f"{k} at {', '.join(sorted(v))}" for k, v in uses.items()
                      if k not in PROBED and k not in NOT_TORCH)
    unused = sorted((set(PROBED) | set(NOT_TORCH)) - set(uses))
    assert not unprobed, "private torch uses with no probe in tests/test_private_torch.py " \
        "(add each to PROBED, or to NOT_TORCH when it is not torch's):\n" + "\n".join(unprobed)
    assert not unused, f"probed but no longer used (remove them): {unused}"


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """On a made-up package: each kind of private torch use is found, keyed as PROBED keys
    them, and the package's own private names and other libraries' module attributes are not."""
    sources = {
        "__init__.py": "",
        "a.py": "import torch\nimport torch.nn as nn\nimport sys\n"
                "from torch.distributed._tools.mem_tracker import MemTracker\n"
                "def f(unit, x):\n"
                "    from torch._guards import active_fake_mode\n"
                "    torch._foreach_mul_(x, 2)\n"
                "    nn.functional._pad(x)\n"
                "    sys._getframe(0)\n"
                "    unit._get_fsdp_state()._own = 1\n"
                "    getattr(unit, '_orig_dtype')\n"
                "    return torch.ops.c10d._reduce_scatter_base_.default\n"
                "class T(MemTracker):\n"
                "    def _update_snap(self, *a):\n"
                "        self._WINFO.clear()\n"
                "        self._mine = self._in_opt\n"
                "    def _helper(self):\n"
                "        return self._mine\n"
                "class Own:\n"
                "    def __init__(self):\n"
                "        self._own = 1\n"
                "W = r'torch\\.distributed\\.fsdp\\._fully_shard\\._fsdp_state\\Z'\n",
    }
    for rel, text in sources.items():
        (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / rel).write_text(text)
    assert sorted(private_uses(tmp_path)) == sorted([
        "torch._guards.active_fake_mode", "torch._foreach_mul_", "torch.nn.functional._pad",
        "._get_fsdp_state", "._orig_dtype", "torch.ops.c10d._reduce_scatter_base_",
        "torch.distributed._tools.mem_tracker.MemTracker",
        f"{MEM_TRACKER}._update_snap", f"{MEM_TRACKER}._WINFO", f"{MEM_TRACKER}._in_opt",
        "torch.distributed.fsdp._fully_shard._fsdp_state"])


def test_the_probe_reports_every_moved_name_at_once(monkeypatch):
    """Two names gone at once: one failure naming both."""
    monkeypatch.setitem(PROBED, "torch.distributed.distributed_c10d._no_such_name", ("x", None))
    monkeypatch.setitem(PROBED, f"{FSDP_COLLECTIVES}._get_gradient_divide_factors",
                        ("y", parameters("reduce_scatter_group", "no_such_parameter")))
    with pytest.raises(AssertionError) as failed:
        test_the_private_torch_names_are_where_the_package_expects_them()
    assert "2 private name(s) moved" in str(failed.value)
    assert "_no_such_name" in str(failed.value) and "no_such_parameter" in str(failed.value)
