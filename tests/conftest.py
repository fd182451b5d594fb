import mlx_flash  # noqa: F401  first, so OpenBLAS is loaded before mlx.core (see mlx_flash/blas.py)

import pytest

from mlx_flash.texts import read_text


@pytest.fixture(scope="session")
def wikitext() -> str:
    """The WikiText-2 test split the package ships."""
    return read_text()


CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "Pack my box with five dozen liquor jugs. " * 40


@pytest.fixture
def float_activations():
    """Float32 activations in the native matvecs. Their int8 default rounds x per block (as llama.cpp does), so
    a test comparing with another path's arithmetic (MLX's ops, stock mlx-lm) would hold only to that rounding."""
    from mlx_flash import cpu_gemv

    cpu_gemv.set_int8_activations(False)
    yield
    cpu_gemv.set_int8_activations(True)


@pytest.fixture
def mlx_ops(monkeypatch):
    """MLX's own ops for quantised products (the native kernels, which take up to NATIVE_ROWS rows, off)."""
    from mlx_flash import cpu_gemv

    monkeypatch.setattr(cpu_gemv, "enabled", False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama model directory and a short text file to calibrate on: (root, src, text path)."""
    from mlx_flash.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny")
    src = make_tiny_model_dir("llama", root / "src")
    data = root / "text.txt"
    data.write_text(CALIBRATION_TEXT)
    return root, src, data
