"""mlx_flash: run LLMs larger than memory, streaming the FFN units each token needs from flash.

model, tokenizer = mlx_flash.load("path/to/flash_dir", memory_budget="auto")  # the default: what the machine can give
text = mlx_flash.generate(model, tokenizer, "Once upon a time", max_tokens=100)
"""

__version__ = "0.1.0"

import warnings  # noqa: E402

from .blas import use_openblas  # noqa: E402  (must run before mlx.core is imported)

use_openblas()

from .errors import (  # noqa: E402
    BudgetError,
    BudgetWarning,
    DiskSpaceError,
    FlashError,
    FlashFormatError,
    ReadError,
    SourceError,
    UnsupportedArchitectureError,
)
from .generate import generate, stream_generate  # noqa: E402
from .loader import load  # noqa: E402

# `python -m mlx_flash.generate` runs the module this package has imported for its functions (as mlx-lm's
# generate does); runpy's warning that it was imported first says nothing to a user
warnings.filterwarnings("ignore", r"'mlx_flash\.generate' found in sys\.modules", RuntimeWarning)

__all__ = [
    "load",
    "generate",
    "stream_generate",
    "FlashError",
    "FlashFormatError",
    "BudgetError",
    "BudgetWarning",
    "SourceError",
    "UnsupportedArchitectureError",
    "ReadError",
    "DiskSpaceError",
]
