"""mlx_flash: run LLMs larger than memory, streaming FFN neurons from flash."""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BudgetError,
    FlashError,
    FlashFormatError,
    ReadError,
    SourceError,
    UnsupportedArchitectureError,
)
