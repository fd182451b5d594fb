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
    """`mlx_flash.generate` and `stream_generate` stay the functions after every module of the package is imported
    (the module `mlx_flash.generate` holds them and the command, as mlx-lm's does); `python -m mlx_flash.generate`
    runs the command without a warning."""
    code = (
        "import pkgutil, importlib, mlx_flash\n"
        "g = importlib.import_module('mlx_flash.generate')\n"
        "for m in pkgutil.walk_packages(mlx_flash.__path__, 'mlx_flash.'):\n"
        "    if not m.name.rsplit('.', 1)[-1].startswith('_'): importlib.import_module(m.name)\n"
        "import mlx_flash.generate\n"
        "from mlx_flash.generate import main\n"
        "assert mlx_flash.generate is g.generate and mlx_flash.stream_generate is g.stream_generate\n"
        "assert callable(mlx_flash.generate) and main.__module__ == 'mlx_flash.generate'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "mlx_flash.generate", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "--memory-budget" in r.stdout and not r.stderr, r.stderr


def test_plotting_without_matplotlib_says_what_to_install(monkeypatch):
    from mlx_flash import FlashError
    from mlx_flash.tools.plot import pyplot

    import pytest

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises ImportError
    with pytest.raises(FlashError, match=r"mlx-flash-runtime\[plot\]"):
        pyplot()
