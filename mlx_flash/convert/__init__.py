"""From a source model to a flash directory and back: `convert` (build), its sources (an mlx-lm or
Hugging Face directory, a hub id, a GGUF file), Wanda pruning, and `export` to a stock mlx-lm directory.

Built on the core (the flash format, the FFN adapters); nothing in the core imports it."""

from .build import convert
from .export import export

__all__ = ["convert", "export"]
