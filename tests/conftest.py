import mlx_flash  # noqa: F401  first, so OpenBLAS is loaded before mlx.core (see mlx_flash/blas.py)
