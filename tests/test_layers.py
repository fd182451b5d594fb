"""The package's layers, as the import graph shows them (grimp reads the source; nothing is imported).

    commands   mlx_flash.<command> modules run with `python -m` (nothing imports them)
    tools      mlx_flash.tools: benchmarks, peers, synthetic models
    calib      mlx_flash.calib: calibration, sparse evaluation, traces
    convert    mlx_flash.convert: source models into flash directories and back
    core       every other module: format, reader, cache, selectors, FFN compute, engine, budget, loader, generation

A layer imports only from the layers below it, and no two modules import each other, directly or not.
"""

import re
from pathlib import Path

import grimp
import pytest

import mlx_flash

ROOT = "mlx_flash"
LAYERS = ["tools", "calib", "convert"]  # top to bottom; the core is below them all
# `python -m mlx_flash.X` modules: commands are run, never imported (importing one used to replace
# the package's function of the same name, see test_package.py)
COMMANDS = {"bench", "bench_io", "calibrate", "cap", "export", "generate", "peers", "reorder", "server", "simulate",
            "synthetic", "synthetic_gguf", "trace", "verify"}


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(ROOT)


def imports(graph, module):
    # `from . import _native` (a compiled extension grimp cannot scan) reads as an import of the package
    # root, and so does `import mlx_flash` for OpenBLAS: the root is the public API on top, not a module
    return {m for m in graph.find_modules_directly_imported_by(module) if m != ROOT}


def layer_of(module: str) -> int:
    """0 for the core, higher for the layers above it; commands on top."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in COMMANDS:
        return len(LAYERS) + 1
    if len(parts) > 1 and parts[1] in LAYERS:
        return len(LAYERS) - LAYERS.index(parts[1])
    return 0


def test_every_command_is_listed():
    """Every top-level module with a `main` is a command (and so nothing may import it)."""
    top = Path(mlx_flash.__path__[0])
    with_main = {p.stem for p in top.glob("*.py") if re.search(r"^def main\(|import .*\bmain\b", p.read_text(), re.M)}
    assert with_main == COMMANDS


def test_layers_import_only_downwards(graph):
    wrong = [(m, i) for m in graph.modules if m != ROOT for i in imports(graph, m) if layer_of(i) > layer_of(m)]
    assert not wrong, "imports from a higher layer: " + ", ".join(f"{m} -> {i}" for m, i in sorted(wrong))


def test_nothing_imports_a_command(graph):
    wrong = [(m, i) for m in graph.modules if m != ROOT for i in imports(graph, m)
             if layer_of(i) == len(LAYERS) + 1]
    assert not wrong, ", ".join(f"{m} -> {i}" for m, i in sorted(wrong))


def test_no_import_cycles(graph):
    modules = sorted(m for m in graph.modules if m != ROOT)
    edges = {m: imports(graph, m) for m in modules}
    state, cycles = {}, []

    def visit(m, path):  # depth-first: a module met again on the current path closes a cycle
        state[m] = "open"
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in modules:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checks_can_fail(graph):
    """The rules above see a violation when there is one: the core's loader really is imported by a tool."""
    assert "mlx_flash.loader" in imports(graph, "mlx_flash.tools.bench")
    assert layer_of("mlx_flash.tools.bench") > layer_of("mlx_flash.loader")
    assert layer_of("mlx_flash.generate") > layer_of("mlx_flash.tools.bench")


def test_internal_imports_at_module_level():
    """No import of the package's own modules inside a function (they hid cycles); the compiled extensions,
    imported in a try block so that the package works without them, are the exception."""
    top = Path(mlx_flash.__path__[0])
    inner = [f"{p.relative_to(top)}: {line.strip()}" for p in top.rglob("*.py") for line in p.read_text().splitlines()
             if re.match(r"\s+from \.", line) and not re.search(r"import _(cpu_gemv|pread_pool) as _native", line)]
    assert not inner, "\n".join(inner)
