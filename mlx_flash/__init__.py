"""mlx_flash: run LLMs larger than memory, streaming FFN neurons from flash."""

__version__ = "0.1.0"

from .blas import use_openblas  # noqa: E402  (must run before mlx.core is imported)

use_openblas()

from .errors import (  # noqa: E402
    BudgetError,
    FlashError,
    FlashFormatError,
    ReadError,
    SourceError,
    UnsupportedArchitectureError,
)
from .loader import load  # noqa: E402


def __getattr__(name):
    # Lazily, so `python -m mlx_flash.generate` does not find its module imported already.
    if name in ("generate", "stream_generate"):
        import importlib

        module = importlib.import_module(".generate", __name__)

        fns = {"generate": module.generate, "stream_generate": module.stream_generate}
        globals().update(fns)  # replaces the submodule attribute the import just set
        return fns[name]
    raise AttributeError(f"module 'mlx_flash' has no attribute {name!r}")


__all__ = [
    "load",
    "generate",
    "stream_generate",
    "FlashError",
    "FlashFormatError",
    "BudgetError",
    "SourceError",
    "UnsupportedArchitectureError",
    "ReadError",
]
