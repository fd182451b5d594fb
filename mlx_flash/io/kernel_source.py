"""Metal kernel source files: where they are, split into named sections (shared by compute.metal's gather_ffn
and format.bitmap)."""

import re
from pathlib import Path
from typing import Optional

# An installed package carries the files in mlx_flash/kernels (see setup.py); a source
# checkout has them in <repo>/kernels.
KERNEL_DIRS = (Path(__file__).parents[1] / "kernels", Path(__file__).parents[2] / "kernels")


def kernel_path(name: str) -> Optional[Path]:
    """The kernel file `name` (e.g. "gather_ffn.metal"), or None if it is not installed."""
    for d in KERNEL_DIRS:
        if (d / name).is_file():
            return d / name
    return None


def split_sections(text: str) -> dict:
    """Sections of a kernel file: {name: text} for each `//== section: <name> ==` marker line."""
    parts = re.split(r"^//== section: (\w+) ==[ \t]*$", text, flags=re.M)
    return {name: body.strip("\n") + "\n" for name, body in zip(parts[1::2], parts[2::2])}
