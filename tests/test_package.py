"""The package stands on its own: its data inside it, no import cycles."""

import grimp

import mlx_flash
from mlx_flash import texts


def test_text_ships_inside_the_package():
    path = texts.wikitext()
    assert path.is_file() and path.is_relative_to(mlx_flash.__path__[0])
    assert (path.parent / "README.md").read_text().count("CC BY-SA 3.0") >= 1  # the licence travels with it
    first, second = texts.read_text(half="first"), texts.read_text(half="second")
    assert first + second == path.read_text() and abs(len(first) - len(second)) < 10_000


def test_no_import_cycles():
    graph = grimp.build_graph("mlx_flash")
    # Python imports the package before any of its modules, so an import of the package itself (e.g. the
    # extensions' `from . import _pread_pool`, which grimp resolves to "mlx_flash") closes no cycle.
    for m in graph.find_modules_that_directly_import("mlx_flash"):
        graph.remove_import(importer=m, imported="mlx_flash")
    cycles = [
        " -> ".join([a, *graph.find_shortest_chain(importer=b, imported=a)])
        for a in sorted(graph.modules)
        for b in graph.find_modules_directly_imported_by(a)
        if graph.chain_exists(importer=b, imported=a)
    ]
    assert cycles == []


def test_generate_stays_the_function_whatever_is_imported():
    """`mlx_flash.generate(...)` is the function even after the server (which runs the same loop) is imported."""
    import mlx_flash
    import mlx_flash.server  # noqa: F401

    assert callable(mlx_flash.generate) and callable(mlx_flash.stream_generate)
