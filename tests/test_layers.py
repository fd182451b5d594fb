"""The package's layers, as the import graph shows them (grimp reads the source; nothing is imported). Bottom to top:

    base       mlx_flash.errors, blas, texts: what every layer may use (of the package they import only errors)
    io         mlx_flash.io: what the process asks of the OS (the pread pool, checksums, kernel files, its memory)
    format     mlx_flash.format: the flash directory on disk, its layouts, and the config and quantisation formats
    compute    mlx_flash.compute: products over units' rows, one backend per layout
    engine     mlx_flash.engine: per step and layer, the units a token needs, read and computed
    core       mlx_flash.models and the root's other modules: the loader, the budget, the generation loop, pipeline
               stages, speculative decoding
    convert    mlx_flash.convert: source models into flash directories and back
    calib      mlx_flash.calib: calibration's parts, sparse evaluation, traces
    tools      mlx_flash.tools: developer tools (the hard cap, synthetic models, I/O benchmarks, plots)
    commands   mlx_flash.<command> modules run with `python -m` (nothing imports them)

`mlx_flash.generate` is the generation loop users import (`mlx_flash.generate`, `stream_generate`) and its
command, as in mlx-lm: it sits in the core.

A module imports only from its own layer and the layers below it, and no two modules import each other, directly or
not.
"""

import ast
import re
from pathlib import Path

import mlx_flash

import grimp
import pytest

ROOT = "mlx_flash"
LAYERS = ["base", "io", "format", "compute", "engine", "core", "convert", "calib", "tools", "commands"]  # bottom up
BASE = {"errors", "blas", "texts"}  # root modules in the base layer; of the package they import only errors
PACKAGES = {  # each sub-package's layer
    "io": "io",
    "format": "format",
    "compute": "compute",
    "engine": "engine",
    "models": "core",
    "convert": "convert",
    "calib": "calib",
    "tools": "tools",
}
# `python -m mlx_flash.X` modules: commands are run, never imported (importing one used to replace
# the package's function of the same name, see test_package.py)
COMMANDS = {"bench", "calibrate", "doctor", "peers", "server", "verify"}
LIBRARY_COMMANDS = {"generate"}  # a command whose functions are the package's API
MAX_ROOT_MODULES = 16  # the API, its core and the commands
MAX_LINES = 800


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(ROOT)


def imports(graph, module):
    # `from . import _native` (a compiled extension grimp cannot scan) reads as an import of the package
    # root, and so does `import mlx_flash` for OpenBLAS: the root is the public API on top, not a module
    return {m for m in graph.find_modules_directly_imported_by(module) if m != ROOT}


def edges_of(graph) -> dict:
    """module -> the package's modules it imports (the root aside)."""
    return {m: imports(graph, m) for m in sorted(graph.modules) if m != ROOT}


def layer_of(module: str) -> int:
    """The module's place in LAYERS (0: the base)."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in BASE:
        return LAYERS.index("base")
    if len(parts) == 2 and parts[1] in COMMANDS:
        return LAYERS.index("commands")
    if parts[1] in PACKAGES:
        return LAYERS.index(PACKAGES[parts[1]])
    return LAYERS.index("core")  # the root's other modules


def upward(edges: dict) -> list:
    """(importer, imported) pairs where a module imports one of a layer above its own."""
    return sorted((m, i) for m, imported in edges.items() for i in imported if layer_of(i) > layer_of(m))


def cycles(edges: dict) -> list:
    """Import cycles, each as the list of its modules (the first again at the end)."""
    state, found = {}, []

    def visit(m, path):  # depth-first: a module met again on the current path closes a cycle
        state[m] = "open"
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                found.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_every_command_is_listed():
    """Every top-level module with a `main` is a command (and so nothing may import it)."""
    top = Path(mlx_flash.__path__[0])
    with_main = {p.stem for p in top.glob("*.py") if re.search(r"^def main\(|import .*\bmain\b", p.read_text(), re.M)}
    assert with_main == COMMANDS | LIBRARY_COMMANDS


def test_root_shows_the_house():
    """Few modules at the package's root (the API and the user's commands); no module too long to read."""
    top = Path(mlx_flash.__path__[0])
    assert len(list(top.glob("*.py"))) <= MAX_ROOT_MODULES
    long = {str(p.relative_to(top)): n for p in top.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_package_has_a_layer():
    """Every sub-package is placed in a layer (a new one is not in the core by default)."""
    top = Path(mlx_flash.__path__[0])
    assert {p.parent.name for p in top.glob("*/__init__.py")} == set(PACKAGES)
    assert set(PACKAGES.values()) | {"base", "commands"} == set(LAYERS)


def test_layers_import_only_downwards(graph):
    wrong = upward(edges_of(graph))
    assert not wrong, "imports from a higher layer: " + ", ".join(f"{m} -> {i}" for m, i in wrong)


def test_base_imports_only_errors(graph):
    wrong = [(m, i) for m in sorted(f"{ROOT}.{b}" for b in BASE) for i in imports(graph, m) if i != f"{ROOT}.errors"]
    assert not wrong, ", ".join(f"{m} -> {i}" for m, i in wrong)


def test_nothing_imports_a_command(graph):
    top = LAYERS.index("commands")
    wrong = [(m, i) for m, imported in edges_of(graph).items() for i in imported if layer_of(i) == top]
    assert not wrong, ", ".join(f"{m} -> {i}" for m, i in sorted(wrong))


def test_no_import_cycles(graph):
    found = cycles(edges_of(graph))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_checks_can_fail(graph):
    """The rules above see a violation when there is one: a command does import the core, and the imports this
    layering removed (the format reading the budget's config keys, the engine asking the models for a model, a
    module of the engine importing one that imports it) are found when put back."""
    edges = edges_of(graph)
    assert "mlx_flash.loader" in edges["mlx_flash.bench"]
    assert layer_of("mlx_flash.bench") > layer_of("mlx_flash.loader") > layer_of("mlx_flash.engine.units")
    below = ("errors", "io.reader", "format.directory", "compute.ops")
    assert [layer_of(f"mlx_flash.{m}") for m in below] == [LAYERS.index(x) for x in ("base", "io", "format", "compute")]
    assert layer_of("mlx_flash.models.stage") == layer_of("mlx_flash.budget") == LAYERS.index("core")
    assert layer_of("mlx_flash.server") > layer_of("mlx_flash.tools.cap") > layer_of("mlx_flash.calib.trace")
    assert "mlx_flash.engine.units" in edges["mlx_flash.engine.experts"]
    back = {
        "mlx_flash.format.directory": {"mlx_flash.budget"},
        "mlx_flash.engine.experts": {"mlx_flash.models"},
        "mlx_flash.engine.units": {"mlx_flash.engine.experts"},
    }
    put_back = {m: edges[m] | back.get(m, set()) for m in edges}
    wrong = upward(put_back)
    assert ("mlx_flash.format.directory", "mlx_flash.budget") in wrong
    assert ("mlx_flash.engine.experts", "mlx_flash.models") in wrong
    assert any({"mlx_flash.engine.experts", "mlx_flash.engine.units"} <= set(c) for c in cycles(put_back))


def test_internal_imports_at_module_level():
    """No import of the package's own modules inside a function (they hid cycles); the compiled extensions,
    imported in a try block so that the package works without them, are the exception."""
    top = Path(mlx_flash.__path__[0])
    inner = [
        f"{p.relative_to(top)}: {line.strip()}"
        for p in top.rglob("*.py")
        for line in p.read_text().splitlines()
        if re.match(r"\s+from \.", line) and not re.search(r"import _(cpu_gemv|pread_pool) as _native", line)
    ]
    assert not inner, "\n".join(inner)


def private_accesses(source: str) -> list:
    """`x._name` where x is not self / cls and nothing in this source defines `_name` (an attribute, function,
    class or variable of that name), and `from mlx_flash... import _name`: reaching into another module's
    internals. Dunders and the compiled extensions aside."""
    tree = ast.parse(source)
    own = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            own.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.arg):
            own.add(n.arg)
    found = []
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.Attribute)
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and n.attr not in own
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
            and ast.unparse(n) != "os._exit"  # the standard library's exit without cleanup (from a watchdog thread)
        ):
            found.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(ROOT)):
            found += [
                f"{n.lineno}: import {a.name}"
                for a in n.names
                if a.name.startswith("_") and not a.name.startswith("__") and a.name not in EXTENSIONS
            ]
    return found


EXTENSIONS = {"_cpu_gemv", "_pread_pool"}


def test_no_module_reaches_into_another_modules_privates():
    """Modules talk through public methods: a private attribute is used only in the module that defines it."""
    top = Path(mlx_flash.__path__[0])
    found = {str(p.relative_to(top)): f for p in sorted(top.rglob("*.py")) if (f := private_accesses(p.read_text()))}
    assert not found, found


def test_the_private_access_check_can_fail():
    assert private_accesses("def f(m):\n    return m._engine\n") == ["2: m._engine"]
    assert private_accesses("from .compute.cpu_gemv import _native\n") == ["1: import _native"]
    assert not private_accesses("class A:\n    def f(self):\n        self._x = 1\n        return A()._x\n")


def test_one_unit_step_and_one_read_ahead():
    """The unit step is written once (engine/units.py) and both kinds of unit go through it; one read-ahead class."""
    engine = Path(mlx_flash.__path__[0]) / "engine"
    trees = {p.name: ast.parse(p.read_text()) for p in engine.glob("*.py")}
    defs = {(name, n.name) for name, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.FunctionDef)}
    classes = [(name, n.name) for name, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.ClassDef)]
    assert [d for d in defs if d[1] in ("step", "_overflow", "_where")] and all(
        name == "units.py" for name, f in defs if f in ("step", "_overflow", "_where")
    )
    for kind in ("neurons.py", "experts.py"):
        calls = [n for n in ast.walk(trees[kind]) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.step"]
        assert calls, f"{kind} does not call the unit step"
    assert [c for c in classes if "ahead" in c[1].lower() or "prefetch" in c[1].lower()] == [
        ("read_ahead.py", "ReadAhead")
    ]
