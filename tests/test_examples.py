"""The example notebooks and the embedding script run top to bottom on the default model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def this_checkout(monkeypatch):
    """Child processes (kernels, scripts) import this checkout's mlx_flash, not another installed one."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.ipynb")))
def test_notebook_runs(name, tmp_path, this_checkout):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import mlx_flash; print(mlx_flash.__file__)"))
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert nb.cells[-1].outputs[0]["text"].startswith(str(ROOT / "mlx_flash"))  # this checkout's package ran


def test_embed_script(this_checkout):
    r = subprocess.run([sys.executable, str(EXAMPLES / "embed_in_app.py")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "MiB read/token" in r.stdout
