"""mlx_flash: run LLMs larger than memory, streaming FFN neurons from flash."""

__version__ = "0.1.0"

import sys  # noqa: E402
import types  # noqa: E402

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


class _Package(types.ModuleType):
    """The command module `mlx_flash.generate` shares its name with the function: importing the module (the import
    system then sets it as the package's attribute) must not replace the function users call."""

    def __setattr__(self, name, value):
        if not (name in __all__ and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
