"""The stored quantisation formats' arithmetic in MLX ops: symmetric codes' implied biases, and columns with block
scales dequantised (convert --down-bits)."""

from typing import Optional

import mlx.core as mx


def symmetric_biases(scales: mx.array, bits: int) -> mx.array:
    """The biases a symmetric quantisation implies (llama.cpp's Q4_0 / Q8_0 in MLX's affine form)."""
    return scales * -(1 << (bits - 1))


def is_symmetric(biases: mx.array, scales: mx.array, bits: int) -> bool:
    """Whether stored biases are exactly those `symmetric_biases` derives, so they need not be stored (finite: an
    overflowed float16 bias would not be what a float32 derivation gives)."""
    return bool(mx.array_equal(biases, symmetric_biases(scales, bits)) and mx.all(mx.isfinite(biases)).item())


def block_dequantize(
    codes: mx.array, blocks: mx.array, scales: mx.array, biases: Optional[mx.array], bits: int, dtype=mx.float32
) -> mx.array:
    """W [k, n]: W_j = scales[blocks[j]] * q_j + biases[blocks[j]] (biases None: symmetric) in `dtype`."""
    biases = symmetric_biases(scales, bits) if biases is None else biases
    ones = mx.ones((codes.shape[0], codes.shape[-1] * 32 // bits // 32), dtype=dtype)  # the codes, as floats
    q = mx.dequantize(codes, ones, mx.zeros_like(ones), 32, bits)
    return scales[blocks].astype(dtype) * q + biases[blocks].astype(dtype)
