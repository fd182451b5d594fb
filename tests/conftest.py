import mlx_flash  # noqa: F401  first, so OpenBLAS is loaded before mlx.core (see mlx_flash/blas.py)

import pytest

from mlx_flash.texts import read_text


@pytest.fixture(scope="session")
def wikitext() -> str:
    """The WikiText-2 test split the package ships."""
    return read_text()
