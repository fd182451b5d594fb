"""The package stands on its own: its data inside it, no import cycles."""

import subprocess
import sys

import mlx_flash
from mlx_flash import texts


def test_text_ships_inside_the_package():
    path = texts.wikitext()
    assert path.is_file() and path.is_relative_to(mlx_flash.__path__[0])
    assert (path.parent / "README.md").read_text().count("CC BY-SA 3.0") >= 1  # the licence travels with it
    first, second = texts.read_text(half="first"), texts.read_text(half="second")
    assert first + second == path.read_text() and abs(len(first) - len(second)) < 10_000


def test_generate_stays_the_function_whatever_is_imported():
    """`mlx_flash.generate` and `stream_generate` stay the functions after every command module is imported (the
    import system sets a submodule as its package's attribute, and `python -m mlx_flash.generate` is a module);
    `from mlx_flash.generate import main` still gives the command."""
    code = (
        "import pkgutil, importlib, mlx_flash, mlx_flash.generation as g\n"
        "for m in pkgutil.iter_modules(mlx_flash.__path__):\n"
        "    if not m.ispkg and not m.name.startswith('_'): importlib.import_module('mlx_flash.' + m.name)\n"
        "import mlx_flash.generate\n"
        "from mlx_flash.generate import main\n"
        "assert mlx_flash.generate is g.generate and mlx_flash.stream_generate is g.stream_generate\n"
        "assert main.__module__ == 'mlx_flash.generate'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_plotting_without_matplotlib_says_what_to_install(monkeypatch):
    import pytest

    from mlx_flash import FlashError
    from mlx_flash.plot import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises ImportError
    with pytest.raises(FlashError, match=r"mlx-flash-runtime\[plot\]"):
        pyplot()
