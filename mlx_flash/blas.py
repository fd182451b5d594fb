"""Use OpenBLAS for MLX's CPU matmuls on Linux.

The `mlx[cpu]` wheel bundles the reference (netlib) BLAS, 8-11x slower than
OpenBLAS for a float32 64x4096 @ 4096x4096 gemm here (benchmarks/cpu_facts.py).
Loading OpenBLAS with RTLD_GLOBAL before `mlx.core` is imported makes MLX resolve
its BLAS symbols there (measured here: equal to LD_PRELOAD). mlx_flash does this on
import unless MLX_FLASH_OPENBLAS=0; if mlx was imported first, it says how to fix it.
"""

import ctypes
import glob
import os
import sys
import warnings

CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

status = "not applicable"  # what happened, for benchmarks and --stats to report


def _openblas_path():
    for pattern in CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


def _loaded(path) -> bool:
    """Is this library mapped already (e.g. LD_PRELOAD)? numpy's own bundled OpenBLAS does not count:
    MLX does not resolve its BLAS symbols there."""
    try:
        with open("/proc/self/maps") as f:
            return os.path.realpath(path) in f.read()
    except OSError:
        return False


def use_openblas() -> str:
    global status
    if not sys.platform.startswith("linux") or os.environ.get("MLX_FLASH_OPENBLAS") == "0":
        status = "not applicable" if not sys.platform.startswith("linux") else "disabled (MLX_FLASH_OPENBLAS=0)"
        return status
    path = _openblas_path()
    if path is not None and _loaded(path):
        status = "openblas"
    elif path is None:
        status = "reference BLAS (install libopenblas0-pthread for ~10x faster float32 matmuls)"
        warnings.warn(f"mlx_flash: {status}", stacklevel=3)
    elif "mlx.core" in sys.modules:
        status = f"reference BLAS (mlx was imported before mlx_flash; import mlx_flash first or set LD_PRELOAD={path})"
        warnings.warn(f"mlx_flash: {status}", stacklevel=3)
    else:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        status = "openblas"
    return status
