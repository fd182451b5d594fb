"""GGML's block quantisations as a GGUF stores them, computed without re-quantising: their sizes and their
dequantisation in MLX ops (the tested reference, and the MLX path's arithmetic: what a Mac runs).

A row of n values is n / VALUES blocks of BYTES bytes each, exactly the GGUF's bytes:

    Q4_0  32 values, 18 B: float16 d, 16 bytes of 4-bit q (value j low nibble of byte j, j + 16 high)
                           w = d * (q - 8)
    Q8_0  32 values, 34 B: float16 d, 32 int8 q;  w = d * q
    Q5_0  32 values, 22 B: float16 d, 32 high bits (value j: bit j), 16 bytes of low 4 bits (as Q4_0's)
                           w = d * (q - 16)
    Q4_K 256 values, 144 B: float16 d, dmin, 12 bytes of 6-bit sub-block scales sc and mins m (8 of 32
                           values), 128 bytes of 4-bit q (chunk c of 64 values: 32 low nibbles, 32 high)
                           w = (d * sc) * q - dmin * m
    Q5_K 256 values, 176 B: Q4_K's with 32 bytes of fifth bits after the scales (bit 2c / 2c + 1 of byte l:
                           values 64c + l / 64c + 32 + l)
    Q6_K 256 values, 210 B: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (of 16 values), float16 d
                           w = (d * sc) * (q - 32)
    Q2_K 256 values, 84 B: 16 bytes of 4-bit scales (low nibble) and mins (high) of 16 values, 64 bytes of 2-bit q
                           (value 128h + 32s + l: bits 2s of byte 32h + l), float16 d, dmin
                           w = (d * sc) * q - dmin * m
    Q3_K 256 values, 110 B: 32 bytes of high bits (value 128h + 32s + l: bit 4h + s of byte l), 64 bytes of low 2 bits
                           (as Q2_K's), 12 bytes of 6-bit scales (of 16 values, less 32), float16 d
                           w = (d * sc) * (q - 4 (where the high bit is 0))
    IQ4_NL 32 values, 18 B: float16 d, 16 bytes of 4-bit indices (as Q4_0's) into a table of 16 int8 values
                           w = d * table[q]
    IQ4_XS 256 values, 136 B: float16 d, 16 bits of the scales' high 2 bits, 4 bytes of their low 4 (of 32 values:
                           6 bits less 32), 128 bytes of 4-bit indices (sub-block j: 16 bytes, as IQ4_NL's)
                           w = (d * sc) * table[q]

The arithmetic is llama.cpp's dequantize_row_* (and the gguf package's), in float32 and in the same order, so
`dequantize` equals gguf.quants.dequantize bit for bit (tests/test_ggml.py).
"""

from functools import partial

import mlx.core as mx

# type -> (values a block, bytes a block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q8_0": (32, 34),
    "Q5_0": (32, 22),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}
# where a block's float16 super-scale d lies where not first (types with mins: dmin next)
D_AT = {"Q6_K": 208, "Q2_K": 80, "Q3_K": 108}
# the i-quants' values of a 4-bit index (llama.cpp's kvalues_iq4nl)
IQ4_TABLE = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def row_bytes(kind: str, n: int) -> int:
    """Bytes of a row of n values of `kind` (n a multiple of its block's values)."""
    values, nbytes = BLOCKS[kind]
    if n % values:
        raise ValueError(f"{kind} rows hold multiples of {values} values, not {n}")
    return n // values * nbytes


def layer_kinds(quant: dict, switch_paths: dict) -> dict:
    """An expert matrix's type in each of its layers ({layer: kind}, keys as switch_paths'): the manifest's
    `{"ggml": kind}`, or `{"ggml": {layer: kind}}` where layers differ (a Q4_K_M file's Q6_K and Q4_K down
    projections). ValueError for a type without kernels or layers that differ from switch_paths'."""
    kinds = quant["ggml"]
    kinds = {k: kinds for k in switch_paths} if isinstance(kinds, str) else kinds
    if not isinstance(kinds, dict) or set(kinds) != set(switch_paths) or not all(k in BLOCKS for k in kinds.values()):
        raise ValueError(f"ggml types {quant['ggml']!r}: one of {', '.join(BLOCKS)} for each expert layer")
    return kinds


def _f16(b: mx.array) -> mx.array:
    """Two bytes [..., 2] (little-endian) -> float32 [...] of the float16 they hold."""
    h = b[..., 0].astype(mx.uint16) | (b[..., 1].astype(mx.uint16) << 8)
    return h.view(mx.float16).astype(mx.float32)


def _nibbles(qs: mx.array) -> mx.array:
    """Bytes [..., c, 32] -> [..., c, 2, 32]: each chunk's low nibbles, then its high ones."""
    return mx.stack([qs & 0x0F, qs >> 4], axis=-2)


def _k_scales(s: mx.array):
    """The 12 bytes of a Q4_K / Q5_K super-block's 6-bit scales and mins [..., 12] -> (sc, m) float32 [..., 8]
    (llama.cpp's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = mx.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(mx.float32), mn.astype(mx.float32)


# types whose blocks are exactly MLX affine 4/8-bit, group 32 (to_affine): MLX's quantised products take them
AFFINE = ("Q4_0", "Q8_0", "Q4_K")
# MLX's temporaries a value of each type takes in a call of its ops (to_affine's repacking, dequantize's float
# copies): MLX allocates a graph's buffers as it dispatches it, ahead of the products that free them, so a layer's
# are alive together (the bit twiddling is compiled into single kernels for that). Measured with float32 products
# (tests/test_in_place.py holds a call to them); 16-bit products add the dequantised copy's cast (2 B) or the
# scales' and biases' (1/8 B).
TEMPORARY_BYTES = {
    "Q4_0": 1.5,
    "Q8_0": 1.75,
    "Q5_0": 8.5,
    "Q4_K": 1.75,
    "Q5_K": 9.5,
    "Q6_K": 7.5,
    "Q2_K": 8,
    "Q3_K": 8.5,
    "IQ4_NL": 8.5,
    "IQ4_XS": 8.5,
}


def temporary_bytes(kind: str, nbytes: int) -> int:
    """MLX's temporaries for a matrix of `nbytes` of `kind` blocks in a call (TEMPORARY_BYTES)."""
    values, size = BLOCKS[kind]
    return int(nbytes // size * values * TEMPORARY_BYTES[kind])


@partial(mx.compile, shapeless=True)
def _pair_codes(p: mx.array) -> mx.array:
    """uint16 words p of a chunk of m bytes of 4-bit q (byte t: value t low, value m + t high), word j its bytes 2j,
    2j + 1 -> words whose low byte is MLX's code byte j (values 2j, 2j + 1) and high byte its code byte m / 2 + j
    (values m + 2j, m + 2j + 1). One compiled kernel: MLX allocates an unfused chain's every step."""
    return (p & 0xF00F) | ((p >> 4) & 0x00F0) | ((p << 4) & 0x0F00)


def _codes4(words: mx.array) -> mx.array:
    """uint16 words [..., chunks, m / 2] of chunks of 4-bit q -> MLX's packing of their values, uint32."""
    r = _pair_codes(words)
    lead = r.shape[:-2]
    return r.view(mx.uint8).reshape(*r.shape, 2).swapaxes(-1, -2).reshape(*lead, -1).view(mx.uint32)


def to_affine(raw: mx.array, kind: str):
    """Rows of `kind` blocks (AFFINE), uint8 [..., row_bytes] -> (codes uint32, scales, biases, bits) of MLX's affine
    quantisation, group 32, holding the same values: what convert wrote for these types before they were read as
    stored (gguf_quants.py), so MLX's quantised products give those bits. Q4_0 / Q8_0: float16 scales, the
    symmetric biases they imply; Q4_K: float32 d * sc and -dmin * m."""
    lead = raw.shape[:-1]
    values, nbytes = BLOCKS[kind]
    b = raw.reshape(*lead, raw.shape[-1] // nbytes, nbytes)
    if kind == "Q8_0":
        d = b[..., :2].view(mx.float16)[..., 0]  # [..., blocks]
        return (b[..., 2:] ^ 0x80).view(mx.uint32).reshape(*lead, -1), d, d * -128, 8  # (int8 q + 128)
    words = raw.view(mx.uint16).reshape(*lead, -1, nbytes // 2)  # (blocks are whole words)
    if kind == "Q4_0":
        d = words[..., 0].view(mx.float16)
        return _codes4(words[..., None, 1:]).reshape(*lead, -1), d, d * -8, 4
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    codes = _codes4(words[..., 8:].reshape(*words.shape[:-1], 4, 16))
    scales, biases = (d[..., None] * sc).reshape(*lead, -1), -(dmin[..., None] * mn).reshape(*lead, -1)
    return codes.reshape(*lead, -1), scales, biases, 4


_Q6_LOW = mx.array([0, 4], dtype=mx.uint8).reshape(2, 1, 1, 1)  # [a]: nibble a
_Q6_HIGH = mx.array([[0, 2], [4, 6]], dtype=mx.uint8).reshape(2, 2, 1, 1)  # [a, c]: bits 2(2a + c)


@partial(mx.compile, shapeless=True)
def _q6(ql: mx.array, qh: mx.array, scale: mx.array) -> mx.array:
    """Q6_K's values scale * (q - 32), broadcast as in dequantize; one compiled kernel (only products: the bits of
    separate ops)."""
    q = ((ql >> _Q6_LOW) & 0x0F) | (((qh >> _Q6_HIGH) & 3) << 4)
    return scale * (q.astype(mx.float32) - 32)


_BITS8 = mx.arange(8, dtype=mx.uint8).reshape(8, 1)
_CRUMB_SHIFTS = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(4, 1)
_NIBBLE_SHIFTS = mx.array([0, 4], dtype=mx.uint8).reshape(2, 1)
_IQ4 = mx.array(IQ4_TABLE, dtype=mx.float32)


@partial(mx.compile, shapeless=True)
def _iq4(qs: mx.array, d: mx.array) -> mx.array:
    """The i-quants' values d * table[q] of bytes qs [..., 16] (low nibbles, then high: [..., 2, 16]); compiled: the
    indices are not a graph's buffers of their own."""
    return d * mx.take(_IQ4, _nibbles(qs))


def _crumbs(qs: mx.array) -> mx.array:
    """Q2_K / Q3_K's 64 bytes of 2-bit q [..., 64] -> uint8 [..., 16, 16] (value 128h + 32s + l: bits 2s of byte
    32h + l)."""
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> _CRUMB_SHIFTS) & 3).reshape(*qs.shape[:-1], 16, 16)


def dequantize(raw: mx.array, kind: str) -> mx.array:
    """Rows of `kind` blocks, uint8 [..., row_bytes] -> float32 [..., n]."""
    values, nbytes = BLOCKS[kind]
    lead = raw.shape[:-1]
    b = raw.reshape(*lead, raw.shape[-1] // nbytes, nbytes)
    if kind == "Q4_0":
        q = _nibbles(b[..., None, 2:]).astype(mx.int16) - 8  # [..., blocks, 1, 2, 16]
        w = _f16(b[..., :2])[..., None] * q.reshape(*b.shape[:-1], 32).astype(mx.float32)
    elif kind == "Q8_0":
        w = _f16(b[..., :2])[..., None] * b[..., 2:].view(mx.int8).astype(mx.float32)
    elif kind == "Q5_0":
        high = ((b[..., 2:6, None] >> _BITS8[:, 0]) & 1).reshape(*b.shape[:-1], 32)  # [..., byte, bit]
        q = _nibbles(b[..., None, 6:]).reshape(*b.shape[:-1], 32) | (high << 4)
        w = _f16(b[..., :2])[..., None] * (q.astype(mx.int16) - 16).astype(mx.float32)
    elif kind == "Q6_K":  # value 128h + 32(2a + c) + 16k + j: [..., h, a, c, k, j]
        ql = b[..., :128].reshape(*b.shape[:-1], 2, 1, 2, 2, 16)  # low bits: nibble a of ql[h, c, k, j]
        qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 1, 2, 16)  # high bits: bits 2(2a + c) of qh[h, k, j]
        sc = b[..., 192:208].view(mx.int8).astype(mx.float32).reshape(*b.shape[:-1], 2, 2, 2, 2, 1)
        w = _q6(ql, qh, _f16(b[..., 208:210]).reshape(*b.shape[:-1], 1, 1, 1, 1, 1) * sc)
    elif kind == "Q2_K":  # sub-block (of 16 values) j: scale and min of byte j
        sc, d, dmin = b[..., :16], _f16(b[..., 80:82]), _f16(b[..., 82:84])
        dl, ml = d[..., None] * (sc & 0x0F).astype(mx.float32), dmin[..., None] * (sc >> 4).astype(mx.float32)
        w = dl[..., None] * _crumbs(b[..., 16:80]).astype(mx.float32) - ml[..., None]
    elif kind == "Q3_K":
        high = ((b[..., None, :32] >> _BITS8) & 1).reshape(*b.shape[:-1], 16, 16)  # [..., 8 bits, 32 bytes]
        q = _crumbs(b[..., 32:96]).astype(mx.int8) - ((high ^ 1) << 2).astype(mx.int8)
        s = b[..., 96:108]
        lo = ((s[..., None, :8] >> _NIBBLE_SHIFTS) & 0x0F).reshape(*b.shape[:-1], 16)  # [..., nibble, byte]
        hi = ((s[..., None, 8:] >> _CRUMB_SHIFTS) & 3).reshape(*b.shape[:-1], 16)  # [..., bits 2k, byte]
        sc = ((lo | (hi << 4)).astype(mx.int8) - 32).astype(mx.float32)
        w = (_f16(b[..., 108:110])[..., None] * sc)[..., None] * q.astype(mx.float32)
    elif kind in ("IQ4_NL", "IQ4_XS"):  # [..., sub-block of 32, 2, 16]
        d = _f16(b[..., :2])[..., None]
        if kind == "IQ4_XS":
            h = b[..., 2].astype(mx.uint16) | (b[..., 3].astype(mx.uint16) << 8)
            lo = ((b[..., 4:8, None] >> _NIBBLE_SHIFTS[:, 0]) & 0x0F).reshape(*b.shape[:-1], 8)  # [..., byte, nibble]
            hi = ((h[..., None] >> (2 * mx.arange(8, dtype=mx.uint16))) & 3).astype(mx.uint8)
            d = d * ((lo | (hi << 4)).astype(mx.int8) - 32).astype(mx.float32)
        w = _iq4(b[..., -values // 2 :].reshape(*b.shape[:-1], values // 32, 16), d[..., None, None])
    else:  # Q4_K, Q5_K
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        q = _nibbles(b[..., -128:].reshape(*b.shape[:-1], 4, 32))  # [..., chunk, lo/hi, 32]
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 1, 32)
            shift = mx.arange(8, dtype=mx.uint8).reshape(4, 2, 1)
            q = q | (((qh >> shift) & 1) << 4)
        q = q.reshape(*b.shape[:-1], 8, 32).astype(mx.float32)
        w = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * mn)[..., None]
    return w.reshape(*lead, -1)


def random_rows(rng, kind: str, rows: int, n: int, scale: float = 1.0, zero_mean: bool = False):
    """Random rows of `kind` blocks as raw bytes, uint8 [rows, row_bytes] (synthetic models, tests): random codes and
    positive sub-block scales, one super-scale d giving each row's outputs against unit-variance inputs about `scale`
    times unit variance. `zero_mean`: the codes' mean offset cancelled (a direction shared by every row would send
    every token of an MoE model to the same few experts): Q4_0's, Q5_0's and Q6_K's low nibbles from 1 (codes
    centred on 8, 16 and 32), Q3_K's low bits from 1 (codes -3..3 but 0), the i-quants' indices from 1 (the table's
    mean nearer 0), the mins of types with mins the codes' mean times their scale."""
    import numpy as np

    values, nbytes = BLOCKS[kind]
    shape = (rows, n // values)
    blocks = rng.integers(0, 256, size=(*shape, nbytes), dtype=np.uint8)

    def codes(at: slice, bits: int, low: int):
        """Fields of `bits` packed in bytes at `at`, each drawn from low..2^bits - 1."""
        f = rng.integers(low, 1 << bits, size=(*shape, at.stop - at.start, 8 // bits), dtype=np.uint8)
        blocks[..., at] = np.bitwise_or.reduce(f << (bits * np.arange(8 // bits, dtype=np.uint8)), axis=-1)

    low = {  # the codes zero_mean draws from 1
        "Q4_0": slice(2, 18),
        "Q5_0": slice(6, 22),
        "Q6_K": slice(0, 128),
        "Q3_K": slice(32, 96),
        "IQ4_NL": slice(2, 18),
        "IQ4_XS": slice(8, 136),
    }
    if zero_mean and kind in low:
        codes(low[kind], 2 if kind == "Q3_K" else 4, 1)
    dmin = {"Q4_K": 8, "Q5_K": 16, "Q2_K": 1}.get(kind)  # dmin / d: a min step of 1/8 (1/16, 1) a scale step
    half = {"Q4_K": 7.5, "Q5_K": 15.5, "Q2_K": 1.5}.get(kind)  # the codes' mean
    if kind == "Q6_K":
        blocks[..., 192:208] = rng.integers(16, 128, size=(*shape, 16), dtype=np.uint8)
    elif kind == "Q2_K":
        sc = rng.integers(2, 11, size=(*shape, 16))
        m = np.rint(sc * half / dmin).astype(np.int64) if zero_mean else rng.integers(0, 16, size=sc.shape)
        blocks[..., :16] = sc | (m << 4)
    elif kind == "Q3_K":  # 6-bit scales 40..63 (8..31 less 32): low nibbles in bytes 0-7, high bits in 8-11
        sc = rng.integers(40, 64, size=(*shape, 16))
        blocks[..., 96:104] = (sc[..., :8] & 15) | ((sc[..., 8:] & 15) << 4)
        blocks[..., 104:108] = np.bitwise_or.reduce(
            (sc >> 4).reshape(*shape, 4, 4) << np.array([[0], [2], [4], [6]]), -2
        )
    elif kind == "IQ4_XS":  # 6-bit scales 40..63: low nibbles in bytes 4-7, high bits in the 16 bits at 2
        sc = rng.integers(40, 64, size=(*shape, 8))
        blocks[..., 4:8] = (sc[..., 0::2] & 15) | ((sc[..., 1::2] & 15) << 4)
        h = np.bitwise_or.reduce((sc >> 4) << (2 * np.arange(8)), axis=-1).astype(np.uint16)
        blocks[..., 2:4] = h[..., None].view(np.uint8)
    elif dmin:
        sc = rng.integers(16, 64, size=(*shape, 8))
        m = np.rint(sc * half / dmin).astype(np.int64) if zero_mean else rng.integers(0, 64, size=sc.shape)
        blocks[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)  # (get_scale_min_k4's packing)
        blocks[..., 8:12] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
        blocks[..., 12:16] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    at = D_AT.get(kind, 0)

    def scales(d):
        blocks[..., at : at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if dmin:
            blocks[..., at + 2 : at + 4] = np.frombuffer(np.float16(dmin * float(np.float16(d))).tobytes(), np.uint8)

    scales(1.0)
    sample = np.asarray(dequantize(mx.array(blocks[:16].reshape(len(blocks[:16]), -1)), kind), np.float64)
    scales(scale / (np.sqrt(n) * np.sqrt(np.mean(sample**2))))
    return blocks.reshape(rows, -1)
