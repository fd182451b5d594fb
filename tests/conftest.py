import mlx_flash  # noqa: F401  first, so OpenBLAS is loaded before mlx.core (see mlx_flash/blas.py)

from pathlib import Path

import pytest

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


@pytest.fixture(scope="session")
def wikitext() -> str:
    """WikiText-2 test split from ../shared (present in CI beside the clone)."""
    if not WIKITEXT.is_file():
        pytest.skip(f"{WIKITEXT} not found (the shared data directory sits beside the repository in CI)")
    return WIKITEXT.read_text()
