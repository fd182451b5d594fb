"""Metal kernel source files split into named sections (shared by gather_ffn and bitmap).

A module of its own so that bitmap (imported by flash_format) needs nothing that imports
flash_format.
"""

import re


def split_sections(text: str) -> dict:
    """Sections of a kernel file: {name: text} for each `//== section: <name> ==` marker line."""
    parts = re.split(r"^//== section: (\w+) ==[ \t]*$", text, flags=re.M)
    return {name: body.strip("\n") + "\n" for name, body in zip(parts[1::2], parts[2::2])}
