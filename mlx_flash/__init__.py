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
from .generation import generate, stream_generate  # noqa: E402  (`python -m mlx_flash.generate` is the command)
from .loader import load  # noqa: E402


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
