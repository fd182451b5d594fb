"""Compute over units' rows: the products of an FFN on one backend per layout (backends.py: MLX ops, native CPU
kernels, Metal kernels), the native kernels' binding (cpu_gemv.py) and the FFN formula over canonical rows (ffn.py).

Nothing is imported here, so that the format can use the kernels without importing the backends."""
