"""OpenBLAS is picked up when mlx_flash is imported first, and a late import says how to fix it."""

import subprocess
import sys

from mlx_flash.blas import _openblas_path

import pytest

MAPPED = f"os.path.realpath({_openblas_path()!r}) in open('/proc/self/maps').read()"

needs_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _openblas_path() is None, reason="Linux with OpenBLAS installed only"
)


def _run(code):
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True)


@needs_openblas
def test_import_first_loads_openblas():
    r = _run(f"import os, numpy, mlx_flash, mlx.core as mx; print(mlx_flash.blas.status); print({MAPPED})")
    assert r.stdout.split() == ["openblas", "True"], r.stderr


@needs_openblas
def test_mlx_imported_first_warns_with_the_fix():
    r = _run("import mlx.core, mlx_flash")
    assert "LD_PRELOAD=" in r.stderr


@needs_openblas
def test_can_be_disabled():
    r = subprocess.run(
        [sys.executable, "-c", f"import os, mlx_flash; print({MAPPED})"],
        capture_output=True,
        text=True,
        env={"MLX_FLASH_OPENBLAS": "0", "PATH": "/usr/bin:/bin"},
    )
    assert r.stdout.strip() == "False", r.stderr
