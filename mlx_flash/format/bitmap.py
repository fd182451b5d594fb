"""ENDOR bitmap sparse rows: a pruned row stored as a bitmap of its non-zeros plus the packed values.

ENDOR ("ENDOR: Hardware-Friendly Sparse Format for Offloaded LLM Inference") stores an unstructured-sparse weight
row as a bitmap of the non-zero positions and the non-zero values, in order, so that a 50%
pruned float16 matrix takes ~56% of its dense bytes. Units on flash must be fixed-stride, so
every encoded row of a matrix gets the same `capacity` (value slots): the largest non-zero
count of the matrix, or a chosen bound.

Byte layout of one encoded row (all integers little-endian):

    offset 0                 bitmap: W = ceil(d / 32) uint32 words (4*W bytes). Element j is
                             non-zero iff bit (j % 32) of word j // 32 is set, i.e. bit j % 8
                             of byte j // 8 (little-endian bit order). Bits >= d are 0.
    offset 4*W               count: uint32, the number of set bits (= non-zeros)
    offset 4*W + 4           values: `capacity` elements of the stored type, the non-zeros in
                             increasing position order, then zeros up to `capacity`
    then                     zero padding to a multiple of 4 bytes

    row_bytes(d, capacity, itemsize) = 4*W + 4 + round_up(capacity * itemsize, 4)

Values are stored bit for bit (float16, bfloat16, float32, or uint8 for 8-bit quantised
values). An element is a "zero" only when all of its bits are 0: -0.0 (sign bit set) is a
non-zero and is stored, so decode(encode(x)) equals x bit for bit for every input.
The values start at a 4-byte aligned offset, so they can be read in place as their type.

Functions:
    encode_rows(rows, capacity=None) -> (encoded uint8 [n, row_bytes], capacity)
    decode_rows(encoded, d, dtype)   -> numpy [n, d] (bfloat16 comes back as its uint16 bits)
    expand(encoded, d, dtype, fill=None) -> mx.array [k, d]: the decoder used at run time;
                                        MLX ops everywhere, a Metal kernel
                                        (kernels/bitmap_expand.metal) when Metal is available;
                                        `fill` [k, G]: per-group value of the unstored positions
    expand_mask(encoded, d)          -> mx.array bool [k, d]: the stored positions
    affine_zero_codes(scales, biases) -> the code of 0.0 per quantisation group (the fill of
                                        8-bit affine rows, see encode_rows' mask)
    compression_ratio(...)           -> encoded bytes / dense bytes
"""

from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ..io import kernel_source

KERNEL_FILE = "bitmap_expand.metal"

# stored dtype name -> (itemsize, unsigned integer type holding the bits, mx dtype)
DTYPES = {
    "float16": (2, np.uint16, mx.float16),
    "bfloat16": (2, np.uint16, mx.bfloat16),
    "float32": (4, np.uint32, mx.float32),
    "uint8": (1, np.uint8, mx.uint8),
}
_MX_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def dtype_name(dtype) -> str:
    """Canonical name ('float16', 'bfloat16', 'float32', 'uint8') of a numpy/mx dtype or name."""
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, mx.Dtype):
        name = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32", mx.uint8: "uint8"}.get(dtype)
    else:
        name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}: expected one of {sorted(DTYPES)}")
    return name


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def bitmap_words(d: int) -> int:
    return (d + 31) // 32


def values_offset(d: int) -> int:
    """Byte offset of the packed values in an encoded row."""
    return 4 * bitmap_words(d) + 4


def row_bytes(d: int, capacity: int, dtype) -> int:
    """Bytes of one encoded row of length d with `capacity` value slots."""
    return values_offset(d) + _round_up(capacity * DTYPES[dtype_name(dtype)][0], 4)


def capacity_of(row_nbytes: int, d: int, dtype) -> int:
    """Value slots of an encoded row of `row_nbytes` bytes (padding slots included)."""
    return (row_nbytes - values_offset(d)) // DTYPES[dtype_name(dtype)][0]


def _bits(rows, dtype) -> Tuple[np.ndarray, str]:
    """Rows as their unsigned-integer bit patterns [n, d] and the dtype name."""
    if isinstance(rows, mx.array):
        name = dtype_name(dtype if dtype is not None else rows.dtype)
        rows = np.array(mx.view(rows, _MX_BITS[DTYPES[name][0]]))
        return rows.reshape(rows.shape[0], -1), name
    rows = np.asarray(rows)
    if dtype is None:
        if rows.dtype == np.uint16:
            raise ValueError("uint16 rows are ambiguous: pass dtype='bfloat16' (or 'float16')")
        dtype = rows.dtype
    name = dtype_name(dtype)
    size, ubits, _ = DTYPES[name]
    if rows.dtype.itemsize != size:
        raise ValueError(f"rows of {rows.dtype} cannot hold {name} values")
    return np.ascontiguousarray(rows).view(ubits).reshape(rows.shape[0], -1), name


def encode_rows(rows, capacity: Optional[int] = None, dtype=None, mask=None) -> Tuple[np.ndarray, int]:
    """Encode rows [n, d] into fixed-size bitmap rows: (uint8 [n, row_bytes(d, capacity)], capacity).

    rows: numpy float16/float32/uint8, numpy uint16 holding bfloat16 bits (pass
    dtype='bfloat16'), or an mx.array of float16/bfloat16/float32/uint8.
    capacity: value slots per row; default the largest non-zero count over the rows (at
    least 1). A row with more non-zeros than `capacity` raises ValueError.
    mask: optional bool [n, d], the positions to store (default: the non-zero bit patterns).
    For MLX affine-quantised values, where q = 0 does not dequantise to 0.0, pass the pruning
    mask: decoding puts q = 0 elsewhere, so the caller must apply expand_mask after
    dequantising (w = where(mask, scale * q + bias, 0)).
    """
    bits, name = _bits(rows, dtype)
    n, d = bits.shape
    size, ubits, _ = DTYPES[name]
    if mask is None:
        mask = bits != 0
    else:
        mask = np.asarray(mask, bool).reshape(n, d)
        bits = np.where(mask, bits, 0).astype(bits.dtype)
    counts = mask.sum(axis=1)
    need = int(counts.max()) if n else 0
    if capacity is None:
        capacity = max(need, 1)
    elif need > capacity:
        raise ValueError(f"a row has {need} non-zeros, more than the capacity {capacity}")
    W = bitmap_words(d)
    stride = row_bytes(d, capacity, name)
    out = np.zeros((n, stride), np.uint8)
    padded = np.zeros((n, 32 * W), bool)
    padded[:, :d] = mask
    out[:, : 4 * W] = np.packbits(padded, axis=1, bitorder="little")
    out[:, 4 * W : 4 * W + 4] = counts.astype("<u4").view(np.uint8).reshape(n, 4)
    vals = np.zeros((n, capacity), ubits)
    # position of each non-zero within its row's value list
    slot = np.cumsum(mask, axis=1) - 1
    r, c = np.nonzero(mask)
    vals[r, slot[r, c]] = bits[r, c]
    off = values_offset(d)
    out[:, off : off + capacity * size] = vals.astype(np.dtype(ubits).newbyteorder("<")).view(np.uint8).reshape(n, -1)
    return out, capacity


def decode_rows(encoded: np.ndarray, d: int, dtype) -> np.ndarray:
    """numpy reference decoder: [n, row_bytes] uint8 -> [n, d] of dtype (bfloat16: uint16 bits)."""
    name = dtype_name(dtype)
    size, ubits, _ = DTYPES[name]
    encoded = np.ascontiguousarray(encoded, np.uint8)
    n = encoded.shape[0]
    cap = capacity_of(encoded.shape[1], d, name)
    W = bitmap_words(d)
    mask = np.unpackbits(encoded[:, : 4 * W], axis=1, bitorder="little")[:, :d].astype(bool)
    off = values_offset(d)
    vals = encoded[:, off : off + cap * size].copy().view(np.dtype(ubits).newbyteorder("<")).astype(ubits)
    out = np.zeros((n, d), ubits)
    slot = np.cumsum(mask, axis=1) - 1
    r, c = np.nonzero(mask)
    out[r, c] = vals[r, slot[r, c]]
    if name in ("float16", "float32"):
        return out.view(np.dtype(name))
    return out


def counts(encoded: np.ndarray, d: int) -> np.ndarray:
    """The stored non-zero count of each encoded row."""
    W = bitmap_words(d)
    return np.ascontiguousarray(encoded[:, 4 * W : 4 * W + 4]).view("<u4").reshape(-1).astype(np.int64)


def compression_ratio(d: int, capacity: int, dtype) -> float:
    """Encoded bytes / dense bytes of one row (the same for the whole matrix: rows are fixed-size)."""
    return row_bytes(d, capacity, dtype) / (d * DTYPES[dtype_name(dtype)][0])


def affine_zero_codes(scales: mx.array, biases: mx.array, bits: int = 8) -> mx.array:
    """uint8 [..., groups]: the code q nearest to dequantising to 0.0 (scale * q + bias = 0) per group.

    MLX's affine quantisation maps 0.0 to exactly this code, so a pruned row quantised by
    mx.quantize holds it at every pruned position: encode only the codes that differ (mask
    = codes != repeat(zero codes)) and fill the rest with it when expanding. Computed in
    float32 with MLX ops, the same at encode and expand time.
    """
    s, b = scales.astype(mx.float32), biases.astype(mx.float32)
    q = mx.round(-b / mx.where(s == 0, 1.0, s))
    return mx.where(s == 0, 0, mx.clip(q, 0, 2**bits - 1)).astype(mx.uint8)


def capacity_for_sparsity(d: int, sparsity: float) -> int:
    """Value slots needed for rows pruned to `sparsity` (at most d - floor(sparsity * d) non-zeros)."""
    return max(d - int(sparsity * d), 1)


# -- expand: MLX ops -----------------------------------------------------------------


# bit i of byte b, as a [256, 8] lookup table (int32: it feeds a cumulative sum)
_BYTE_BITS = mx.array(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(np.int32)
)


def _bitmap_bits(encoded: mx.array, d: int) -> mx.array:
    """The bitmap of encoded rows as int32 0/1 [k, d] (a table lookup per byte)."""
    nb = (d + 7) // 8
    return mx.take(_BYTE_BITS, encoded[:, :nb], axis=0).reshape(encoded.shape[0], nb * 8)[:, :d]


def expand_mask(encoded: mx.array, d: int) -> mx.array:
    """The bitmap of encoded rows as bool [k, d] (True = stored position)."""
    return _bitmap_bits(encoded, d).astype(mx.bool_)


def _check_fill(fill: mx.array, k: int, d: int) -> int:
    if fill.ndim != 2 or fill.shape[0] != k or d % fill.shape[1]:
        raise ValueError(f"fill must be [k={k}, G] with G dividing d={d}, got {tuple(fill.shape)}")
    return d // fill.shape[1]


def expand_mlx(encoded: mx.array, d: int, dtype, fill: Optional[mx.array] = None) -> mx.array:
    """MLX-ops decoder: uint8 [k, row_bytes] -> [k, d] of dtype. See `expand`.

    slot_j = bit_j * (bit_0 + ... + bit_j) is 0 for a zero and 1 + the index of its value
    for a non-zero; gathering from [0, values...] with it yields the dense row (bit patterns,
    so -0.0 survives), with no `where`. With a fill, a zero gathers its group's fill value
    from [values..., fill...] instead.
    """
    name = dtype_name(dtype)
    size, _, mdtype = DTYPES[name]
    k, nbytes = encoded.shape
    cap = capacity_of(nbytes, d, name)
    bits = _bitmap_bits(encoded, d)
    off = values_offset(d)
    ubits = _MX_BITS[size]
    vals = mx.view(encoded[:, off : off + cap * size], ubits)  # [k, cap] bit patterns
    if fill is None:
        slot = mx.cumsum(bits, axis=1) * bits
        vals = mx.concatenate([mx.zeros((k, 1), ubits), vals], axis=1)
        out = mx.take_along_axis(vals, mx.minimum(slot, cap), axis=1)
    else:
        group = _check_fill(fill, k, d)
        slot = mx.minimum(mx.cumsum(bits, axis=1) - 1, cap - 1)
        slot = mx.where(bits.astype(mx.bool_), slot, cap + mx.arange(d, dtype=mx.int32) // group)
        vals = mx.concatenate([vals, mx.view(fill.astype(mdtype), ubits)], axis=1)
        out = mx.take_along_axis(vals, slot, axis=1)
    return out if mdtype == ubits else mx.view(out, mdtype)


# -- expand: Metal -------------------------------------------------------------------


def _build_kernel():
    path = kernel_source.kernel_path(KERNEL_FILE)
    if path is None:
        return {}, None
    src = kernel_source.split_sections(path.read_text())
    return src, mx.fast.metal_kernel(
        name="bitmap_expand",
        input_names=["enc"],
        output_names=["out"],
        source=src["expand"],
        header=src.get("header", ""),
    )


# Built once at import (building needs no Metal; only calling does).
KERNEL_SOURCES, _expand_kernel = _build_kernel()


def metal_available() -> bool:
    return mx.metal.is_available() and _expand_kernel is not None


def expand_metal(encoded: mx.array, d: int, dtype) -> mx.array:
    """Metal decoder: one thread per bitmap word (popcount prefix of the words before it)."""
    if not metal_available():
        raise RuntimeError("the bitmap_expand Metal kernel needs Metal (Apple silicon)")
    name = dtype_name(dtype)
    size, _, mdtype = DTYPES[name]
    k, nbytes = encoded.shape
    W = bitmap_words(d)
    ubits = _MX_BITS[size]
    (out,) = _expand_kernel(
        inputs=[encoded],
        template=[
            ("U", ubits),
            ("D", d),
            ("NWORDS", W),
            ("STRIDE", nbytes),
            ("VAL_OFF", values_offset(d)),
            ("CAP", capacity_of(nbytes, d, name)),
        ],
        grid=(W, k, 1),
        threadgroup=(min(W, 256), 1, 1),
        output_shapes=[(k, d)],
        output_dtypes=[ubits],
    )
    return out if mdtype == ubits else mx.view(out, mdtype)


def expand(
    encoded: mx.array, d: int, dtype, use_metal: Optional[bool] = None, fill: Optional[mx.array] = None
) -> mx.array:
    """Decode encoded rows on the device: uint8 [k, row_bytes] -> [k, d] of dtype (mx dtype or name).

    `encoded` holds whole encoded rows (slice a component out of a wider cache row first);
    the result equals decode_rows bit for bit. use_metal: None = Metal when available,
    True = insist, False = MLX ops. fill: None (unstored positions are all-zero bits) or
    [k, G] values for the unstored positions of each of G equal groups of a row (e.g. the
    affine_zero_codes of 8-bit rows; G divides d).
    """
    if use_metal is None:
        use_metal = metal_available()
    if not use_metal:
        return expand_mlx(encoded, d, dtype, fill)
    out = expand_metal(encoded, d, dtype)
    if fill is None:
        return out
    k, group = encoded.shape[0], _check_fill(fill, encoded.shape[0], d)
    unstored = mx.logical_not(expand_mask(encoded, d)).reshape(k, -1, group)
    return mx.where(unstored, fill.astype(out.dtype)[:, :, None], out.reshape(k, -1, group)).reshape(k, d)
