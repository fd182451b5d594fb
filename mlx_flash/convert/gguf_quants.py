"""GGUF quantisation blocks -> MLX quantised arrays (what gguf.py stores for each tensor type).

Weights (GGUF type -> what the mlx-lm directory stores)
  * Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 -> MLX affine 4/8/5-bit, group 32 (.weight uint32, .scales, .biases in
    float16) without any loss: these block formats are exactly affine per 32 values.
  * Q4_K, Q5_K -> MLX affine 4/5-bit, group 32, exactly, with float32 scales and biases: a super-block of 256
    is 8 sub-blocks of 32 computing d * sc * q - dmin * m, and d * sc (a float16 times a 6-bit integer) is exact
    in float32, not in float16: 6 (7) bits a weight against the file's 4.5 (5.5). Only where every layer's
    tensor of the role (blk.*.ffn_down, ...) has the type: a flash directory's layers share one layout, so a
    role mixing types (Q4_K_M keeps some ffn_down in Q6_K) is re-quantised alike, as below.
  * F32/F16/BF16 -> kept as they are.
  * Every other type (Q6_K, Q2_K, Q3_K, IQ*, ...) is dequantised with the `gguf` package and re-quantised to
    MLX 8-bit, group 32 (REQUANT). Relative RMS error against gguf's dequantised values, measured on random
    blocks (tests/test_gguf.py): Q2_K 2.9e-3, Q3_K 4.5e-3, Q6_K 4.5e-3, IQ4_NL 4.0e-3 (8-bit group 64: about
    1.3x more), a few percent of the source's own quantisation step, so the model keeps the GGUF's quality.
    4-bit re-quantisation is no option: MLX's grid differs from llama.cpp's, and a held-out measurement
    (BENCHMARKS.md) found Q4_K_M re-quantised to MLX 4-bit group 64 at +41% perplexity, 8-bit lossless.
    Such tensors take 9 bits per weight instead of 2.6-6.6; 1-D ones become float16.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict

import numpy as np

from ..errors import SourceError

GROUP_SIZE = 32  # block size of Q4_0 / Q4_1 / Q8_0 / Q5_* and a K-quant's sub-block = MLX group size
# (group size, bits) of tensors MLX cannot hold exactly (Q6_K, Q2_K, Q3_K, IQ*, mixed roles): 8-bit keeps them
# within 0.5% (RMS) of gguf's dequantisation; 4-bit re-quantisation costs far more (see the docstring).
REQUANT = (32, 8)


def repackers(mixed: bool) -> dict:
    """GGML type -> the function turning rows of its blocks into (codes, scales, biases or None, bits) for a tensor
    whose role (`role`) is `mixed` or not: the UNIFORM types are kept as they are only in a role of one type."""
    import gguf

    T = gguf.GGMLQuantizationType
    exact = {
        T.Q8_0: _repack_q8_0,
        T.Q4_0: lambda raw: _repack_q4(raw, 18),
        T.Q4_1: lambda raw: _repack_q4(raw, 20),
        T.MXFP4: _repack_mxfp4,
    }
    if mixed:
        return exact
    return {
        **exact,
        T.Q5_0: lambda raw: _repack_q5(raw, 22),
        T.Q5_1: lambda raw: _repack_q5(raw, 24),
        T.Q4_K: lambda raw: _repack_k(raw, 4),
        T.Q5_K: lambda raw: _repack_k(raw, 5),
    }


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16)


def _repack_q8_0(raw: np.ndarray):
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 34)
    d = _f16(b[..., :2])[..., 0]
    q = np.ascontiguousarray(b[..., 2:]) ^ np.uint8(0x80)  # int8 two's complement -> q + 128
    return q.reshape(rows, -1).view(np.uint32), d, (d.astype(np.float32) * -128).astype(np.float16), 8


def _repack_q4(raw: np.ndarray, block: int):
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, block)
    d = _f16(b[..., :2])[..., 0]
    if block == 18:  # Q4_0: w = d * (q - 8)
        bias = (d.astype(np.float32) * -8).astype(np.float16)
        qs = b[..., 2:]
    else:  # Q4_1: w = d * q + m
        bias = _f16(b[..., 2:4])[..., 0]
        qs = b[..., 4:]
    return _mlx_nibbles(qs), d, bias, 4


def _mlx_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 4-bit blocks' 16 code bytes [rows, blocks, 16] -> MLX's packing, uint32 [rows, blocks * 4]."""
    # GGUF: byte j holds value j (low nibble) and value j + 16 (high nibble).
    vals = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    # MLX: byte j holds value 2j (low nibble) and 2j + 1 (high nibble), little-endian uint32 words.
    packed = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed).reshape(qs.shape[0], -1).view(np.uint32)


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, n] (n a multiple of 32) -> MLX's packing: a little-endian bit stream, value i at bits
    [bits * i, bits * (i + 1)) of its row, as uint32 words."""
    rows, n = codes.shape
    eight = codes.reshape(rows, n // 8, 8).astype(np.uint64) << (np.arange(8, dtype=np.uint64) * bits)
    words = np.bitwise_or.reduce(eight, axis=-1)  # 8 values in `bits` bytes
    out = words[..., None].view(np.uint8)[..., :bits]  # (little-endian)
    return np.ascontiguousarray(out).reshape(rows, -1).view(np.uint32)


def _repack_q5(raw: np.ndarray, block: int):
    """Q5_0 (w = d * (q - 16)) and Q5_1 (w = d * q + m): 5-bit codes, group 32, exactly as MLX affine 5-bit."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, block)
    d = _f16(b[..., :2])[..., 0]
    if block == 22:
        bias, at = (d.astype(np.float32) * -16).astype(np.float16), 2
    else:
        bias, at = _f16(b[..., 2:4])[..., 0], 4
    qh = np.ascontiguousarray(b[..., at : at + 4]).view("<u4")  # bit i: value i's fifth bit
    qs = b[..., at + 4 :]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # values 0-15 low nibbles, 16-31 high
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _pack_codes((low | high).reshape(rows, -1), 5), d, bias, 5


def _k_scales(sc: np.ndarray):
    """K-quants' 12 bytes of 6-bit sub-block scales and mins [..., 12] -> (scales, mins) [..., 8] (llama.cpp's
    get_scale_min_k4)."""
    q = sc.astype(np.uint8)
    scales = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return scales, mins


def _repack_k(raw: np.ndarray, bits: int):
    """Q4_K / Q5_K: super-blocks of 256 = 8 sub-blocks of 32, w = d * sc * q - dmin * m: MLX affine 4/5-bit, group
    32, exactly, with float32 scales d * sc and biases -dmin * m (products of a float16 and a 6-bit integer)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 144 if bits == 4 else 176)
    d, dmin = (_f16(b[..., i : i + 2])[..., 0].astype(np.float32) for i in (0, 2))
    sc, m = _k_scales(b[..., 4:16])
    qs = b[..., -128:].reshape(*b.shape[:2], 4, 32)  # 4 chunks of 64 values: low nibbles, then high
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [rows, blocks, chunk, half, 32]
    if bits == 5:
        qh = b[..., 16:48]  # bit 2c (+1) of byte l: value 64c + l (+ 32)'s fifth bit
        shift = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
        codes = codes | (((qh[..., None, None, :] >> shift) & 1) << 4)
    scales = d[..., None] * sc.astype(np.float32)
    biases = -(dmin[..., None] * m.astype(np.float32))
    return _pack_codes(codes.reshape(rows, -1), bits), scales.reshape(rows, -1), biases.reshape(rows, -1), bits


def _repack_mxfp4(raw: np.ndarray):
    """GGML MXFP4 (17 B per 32: an e8m0 scale byte, then Q4_0's nibble order) -> MLX mxfp4: the same e2m1 codes
    and the same scale byte (2^(e - 127)); only the nibbles are reordered."""
    b = raw.reshape(raw.shape[0], -1, 17)
    return _mlx_nibbles(b[..., 1:]), np.ascontiguousarray(b[..., 0]), None, 4


def dequantize(raw: np.ndarray, t, path: Path) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.dequantize(raw, t.tensor_type)
    except NotImplementedError:
        raise SourceError(
            f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf package cannot dequantise"
        ) from None


def requantize(raw: np.ndarray, t, path: Path, chunk_values: int = 1 << 24) -> Dict[str, object]:
    """Rows of blocks of a GGUF type MLX has no exact equivalent of -> MLX affine REQUANT (8-bit, group 32),
    dequantised a few rows at a time so that only a chunk is ever held in float32."""
    import mlx.core as mx

    rows_per_chunk = max(1, chunk_values * raw.shape[1] // raw.size)
    parts = []
    for i in range(0, raw.shape[0], rows_per_chunk):
        w = mx.array(dequantize(raw[i : i + rows_per_chunk], t, path).astype(np.float32))
        q, scales, biases = mx.quantize(w, group_size=REQUANT[0], bits=REQUANT[1])
        parts.append((q, scales.astype(mx.float16), biases.astype(mx.float16)))
        mx.eval(parts[-1])
    return {k: mx.concatenate([p[j] for p in parts]) for j, k in enumerate(("weight", "scales", "biases"))}


def role(name: str) -> str:
    """A tensor's name without its layer: the tensors every layer has one of ("blk.*.ffn_down.weight")."""
    parts = name.split(".")
    return ".".join("*" if i == 1 and parts[0] == "blk" else p for i, p in enumerate(parts))


# a block's tensors read from flash as units (by base name): a flash directory's layers share their layout
STREAMED = re.compile(r"\.ffn_(gate|up|down|gate_up)(_exps)?$")


def mixed_roles(tensors) -> set:
    """The roles (`role`) of streamed tensors (STREAMED) whose layers differ in type: re-quantised alike, as a flash
    directory's layers share one layout (a resident module has its own quantisation)."""
    types = {}
    for t in tensors:
        if STREAMED.search(t.name.removesuffix(".weight")):
            types.setdefault(role(t.name), set()).add(t.tensor_type)
    return {role for role, kinds in types.items() if len(kinds) > 1}


# GGUF types held exactly as MLX affine (or mxfp4) codes, group 32: (bits, bytes of scales and biases a group); the
# last four only in a role of one type (`mixed_roles`)
EXACT = {
    "Q8_0": (8, 4),
    "Q4_0": (4, 4),
    "Q4_1": (4, 4),
    "MXFP4": (4, 1),  # (uint8 scales)
    "Q5_0": (5, 4),
    "Q5_1": (5, 4),
    "Q4_K": (4, 8),  # (float32 scales and biases)
    "Q5_K": (5, 8),
}


UNIFORM = ("Q5_0", "Q5_1", "Q4_K", "Q5_K")


def by_rows(repack, raw: np.ndarray, chunk_bytes: int = 1 << 24):
    """`repack` over a few rows of blocks at a time (its temporaries are several times its input), joined."""
    rows = max(1, chunk_bytes // raw.shape[1])
    if raw.shape[0] <= rows:
        return repack(raw)
    out = None
    for i in range(0, raw.shape[0], rows):
        *parts, bits = repack(raw[i : i + rows])
        if out is None:
            out = [None if p is None else np.empty((raw.shape[0], *p.shape[1:]), p.dtype) for p in parts]
        for o, p in zip(out, parts):
            if o is not None:
                o[i : i + len(p)] = p
    return (*out, bits)
