"""The example notebooks and the embedding script run top to bottom on the default model."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.ipynb")))
def test_notebook_runs(name, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()


def test_embed_script():
    r = subprocess.run([sys.executable, str(EXAMPLES / "embed_in_app.py")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "MiB read/token" in r.stdout
