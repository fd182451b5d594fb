"""Compute over units' rows: the products of an FFN on one backend per layout (backends.py: MLX ops, native CPU
kernels, Metal kernels), the native kernels' binding (cpu_gemv.py) and the FFN formula over canonical rows (ffn.py).

Built on format, io and the base modules; nothing is imported here."""
