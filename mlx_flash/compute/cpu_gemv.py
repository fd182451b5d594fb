"""Quantised matrix-vector products for decoding on MLX's CPU backend (kernels/cpu_gemv.c).

MLX's CPU quantized_matmul computes about 1 G weights/s here (a 4-bit 4096x4096 matvec in
16 ms; BENCHMARKS.md "CPU kernels"), so on a CPU decode time is mostly that kernel. The C
extension dequantises in registers and accumulates in float32 (AVX2, or AVX-512 where the CPU has
it: the same bits; on OpenMP threads) straight from where the rows are stored:

    row_dot(x, q, slots)    out[j] = sum_i x[i] W[slots[j]][i]   (x @ W[slots]^T)
    row_axpy(c, q, slots)   out[i] = sum_j c[j] W[slots[j]][i]   (c @ W[slots])

for `QuantRows` q: a neuron cache's rows in place (gather_ffn, no gathered copy) or the three
arrays of a quantised linear layer. `patch(model)` makes the model's QuantizedLinear and
QuantizedEmbedding.as_linear use it. It applies to up to NATIVE_ROWS float32 rows (decode steps, verification
passes) of 2/4/8-bit
affine weights while MLX computes on the CPU; everything else (long prompts, other dtypes, Metal)
keeps MLX's ops. MLX_FLASH_CPU_KERNELS=0, or `enabled = False`, turns it off.

The calls are eager: they evaluate their input, so each is a synchronisation point of MLX's
lazy graph (cheap next to the matvec it replaces).
"""

import contextvars
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..format.quant import block_dequantize, symmetric_biases

# Before libgomp starts: idle OpenMP threads spin ~0.1 s, then sleep (libomp's KMP_BLOCKTIME is 0.2 s).
# A decode step runs several parallel loops per layer with Python and waits for reads of a few ms between
# them, and waking a sleeping thread costs more than a matvec: threads keep spinning across those gaps
# (the measurements are in BENCHMARKS.md, "CPU notes").
os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

try:
    from .. import _cpu_gemv as _native
except ImportError:  # not built: MLX's ops everywhere
    _native = None

SCALE_TYPES = {mx.float16: 0, mx.bfloat16: 1, mx.float32: 2}

# MLX_FLASH_BACKEND=mlx: MLX's own ops everywhere, the arithmetic a Mac runs (engine/forward.py)
enabled = os.environ.get("MLX_FLASH_CPU_KERNELS", "1") != "0" and os.environ.get("MLX_FLASH_BACKEND") != "mlx"


def set_int8_activations(on: bool) -> None:
    """row_dot with x rounded to int8 per block of 32 against 4/8-bit codes (integer dot products, as
    llama.cpp's Q8 x Q4 kernels; the default: 2-4x faster) or in float32 (the reference; MLX_FLASH_INT8=0).
    A few outlier elements of x stay in float either way (kernels/cpu_gemv.c)."""
    if _native is not None:
        _native.set_int8(bool(on))


set_int8_activations(os.environ.get("MLX_FLASH_INT8", "1") != "0")


def int8_activations() -> bool:
    """Whether row_dot rounds x to int8 (`set_int8_activations`)."""
    return bool(info().get("int8"))


def set_avx512(on: bool) -> None:
    """The AVX-512 loops where the CPU has them (AVX-512 F/BW/VL/VNNI; the default) or the AVX2 / AVX-VNNI ones
    (MLX_FLASH_AVX512=0). Both give the same bits (tests/test_cpu_gemv.py compares them); `info()["avx512"]` says which
    run."""
    if _native is not None:
        _native.set_avx512(bool(on))


set_avx512(os.environ.get("MLX_FLASH_AVX512", "1") != "0")


def attention(x: np.ndarray, h: np.ndarray, *args) -> None:
    """A decoder layer's attention on host rows, in place (kernels/cpu_gemv.c: x += attention(norm1(x)), the KV
    written at its position, h = norm2(x)); args as the kernel takes them (native_step.py)."""
    _native.attention(x, h, *args)


def attention_batch(x: np.ndarray, h: np.ndarray, *args) -> None:
    """`attention` of several sequences in one pass: args as the kernel takes them, the caches and positions as
    segments [(keys, values, pos, cap, m), ...] in x's row order (native_step.HostDecoder)."""
    _native.attention_batch(x, h, *args)


def available() -> bool:
    """The extension is built, enabled, and MLX computes on the CPU."""
    return _native is not None and enabled and mx.default_device() == mx.cpu


def info() -> dict:
    """{"avx2", "vnni", "avx512_cpu": CPU has them, "simd": AVX2 loops in use, "avx512": AVX-512 loops in use,
    "int8": int8 activations, "threads": OpenMP threads} ({} if not built)."""
    return _native.info() if _native is not None else {}


def supports(bits: int, group_size: int, n: int, scale_dtype) -> bool:
    return bits in (2, 4, 8) and n % group_size == 0 and (group_size * bits) % 8 == 0 and scale_dtype in SCALE_TYPES


@dataclass(frozen=True)
class QuantRows:
    """Rows r of an affine-quantised matrix: packed weights at w[w_off + r * w_stride], scales and
    biases likewise (buffers: evaluated mx.arrays or numpy arrays); n values per row."""

    w: object
    w_off: int
    w_stride: int
    s: object
    s_off: int
    s_stride: int
    b: object
    b_off: int
    b_stride: int
    n: int
    bits: int
    group_size: int
    scale_dtype: mx.Dtype
    symmetric: bool = False  # no biases stored (b is ignored): bias = -2^(bits-1) * scale, as llama.cpp's Q4_0

    @classmethod
    def of_matrix(
        cls, weight: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int, bits: int
    ) -> "QuantRows":
        """The rows of a quantised [rows, n] matrix as MLX stores it (weight uint32 [rows, n * bits / 32]; biases
        None: symmetric)."""
        symmetric = biases is None
        biases = scales if symmetric else biases
        return cls(
            weight,
            0,
            weight.shape[-1] * 4,
            scales,
            0,
            scales.shape[-1] * scales.itemsize,
            biases,
            0,
            biases.shape[-1] * biases.itemsize,
            weight.shape[-1] * 32 // bits,
            bits,
            group_size,
            scales.dtype,
            symmetric,
        )

    def _args(self, slots, k):
        return (
            self.w,
            self.w_off,
            self.w_stride,
            self.s,
            self.s_off,
            self.s_stride,
            self.b,
            self.b_off,
            self.b_stride,
            slots,
            k,
            self.n,
            self.bits,
            self.group_size,
            SCALE_TYPES[self.scale_dtype],
            self.symmetric,
        )


def _slots(slots) -> Optional[np.ndarray]:
    if slots is None:
        return None
    if isinstance(slots, Addresses):
        return slots.at
    return np.ascontiguousarray(np.asarray(slots).reshape(-1), dtype=np.int32)


class Addresses:
    """Rows given by where they start in memory (int64 [k], compute.rows.RowSet.addresses) instead of slots in one
    buffer: the kernels add the matrix's offsets and read them in place. The caller holds their buffers."""

    def __init__(self, at: np.ndarray):
        self.at = np.ascontiguousarray(at, dtype=np.int64)

    def __len__(self):
        return len(self.at)


def _dst(dst, n_out: int, shape) -> tuple:
    """(the kernels' trailing dst arguments, out's shape): with dst (int32 [k], non-decreasing) row j adds into
    out[dst[j]], one of n_out partial sums."""
    if dst is None:
        return (), shape
    return (np.ascontiguousarray(dst, dtype=np.int32), n_out), (n_out, *shape)


def row_dot(x: np.ndarray, q: QuantRows, slots=None, k: Optional[int] = None) -> np.ndarray:
    """float32 [..., k]: out[..., j] = x[...] . W[slots[j]] (slots None: rows 0..k-1); x [n] or [m, n] (m
    positions: each row's bytes are read once for all)."""
    slots = _slots(slots)
    k = len(slots) if slots is not None else k
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((*x.shape[:-1], k), dtype=np.float32)
    _native.row_dot(x, out, *q._args(slots, k))
    return out


# format/ggml.py's block types, as the kernels number them
GGML_KINDS = {"Q4_0": 0, "Q8_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "Q2_K": 5, "Q3_K": 6, "IQ4_NL": 7, "IQ4_XS": 8,
              "Q5_0": 9}  # fmt: skip


def block_dot(
    x: np.ndarray, w, offs, stride: int, kind: str, n: int, slots=None, k: Optional[int] = None
) -> np.ndarray:
    """float32 [..., k, len(offs)]: x . row j of each matrix whose rows of GGML `kind` blocks (format/ggml.py) lie at
    w[offs[t] + slots[j] * stride] (slots None: rows 0..k-1; Addresses: rows where they start); x [n] or [m, n]."""
    slots = _slots(slots)
    k = len(slots) if slots is not None else k
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((*x.shape[:-1], k, len(offs)), dtype=np.float32)
    _native.block_dot(x, out, w, tuple(offs), stride, slots, k, n, GGML_KINDS[kind])
    return out


def expert_glu(
    x: np.ndarray, addresses: np.ndarray, offs: tuple, hidden: int, n_out: int, kind_gu: str, kind_down: str
) -> np.ndarray:
    """float32 [E, m, n_out]: down(silu(gate x) * up x) of each SwiGLU expert of GGML blocks whose rows start at
    addresses[e] (int64; gate and up `hidden` rows of kind_gu at offs[0] and offs[1] from it, down n_out rows of
    kind_down at offs[2]), for x [m, n]: `block_dot` of gate and up, `glu_pairs`, `block_dot` of down, bit for bit,
    in one pass over the experts (x quantised once). The caller holds the rows' buffers."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    addresses = np.ascontiguousarray(addresses, dtype=np.int64)
    out = np.empty((len(addresses), len(x), n_out), dtype=np.float32)
    _native.expert_glu(x, out, addresses, *offs, hidden, x.shape[1], n_out, GGML_KINDS[kind_gu], GGML_KINDS[kind_down])
    return out


def block_linear(w, k: int, n: int, kind: str):
    """A native handle on k rows of n values of GGML `kind` blocks in w (held while it lives), for
    `_native.attention`."""
    return _native.block_linear(w, k, n, GGML_KINDS[kind])


def row_dot_pairs(x: np.ndarray, a: QuantRows, b: QuantRows, slots=None, k: Optional[int] = None) -> np.ndarray:
    """float32 [..., k, 2]: `row_dot` of a and of b in one pass, where b is another matrix of the same rows (the same
    buffers and strides at other offsets, as a GLU's gate and up in a unit): each row's two are read side by side,
    and each result is, bit for bit, its own row_dot's."""
    args, out = _pairs_args(x, a, b, slots, k)
    _native.row_dot_pairs(*args)
    return out


def _pairs_args(x, a: QuantRows, b: QuantRows, slots, k) -> tuple:
    """(the native row_dot_pairs' arguments, their output)."""
    if any(getattr(a, f) is not getattr(b, f) for f in ("w", "s", "b")) or (
        (a.w_stride, a.s_stride, a.b_stride, a.n, a.bits, a.group_size, a.scale_dtype, a.symmetric)
        != (b.w_stride, b.s_stride, b.b_stride, b.n, b.bits, b.group_size, b.scale_dtype, b.symmetric)
    ):
        raise ValueError("row_dot_pairs: the two matrices must lie in the same rows, quantised alike")
    slots = _slots(slots)
    k = len(slots) if slots is not None else k
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((*x.shape[:-1], k, 2), dtype=np.float32)
    return (b.w_off - a.w_off, b.s_off - a.s_off, b.b_off - a.b_off, x, out, *a._args(slots, k)), out


def ffn_glu(x: np.ndarray, gate: QuantRows, up: QuantRows, slots, down: tuple, dst=None, n_out: int = 1) -> np.ndarray:
    """block_axpy(glu_pairs(row_dot_pairs(x, gate, up, slots)), *down, dst, n_out), down = block_axpy's arguments
    after c (their slots those of gate and up), bit for bit: a row's units in one pass, each unit's rows read whole
    and in order, where the loops allow it (kernels/cpu_gemv.c, ffn_glu)."""
    return FfnGlu(gate, up, slots, down, dst, n_out)(x)


class FfnGlu:
    """`ffn_glu` with everything but x bound: its arguments checked and laid out once, for a layer that calls it
    with the same rows every step. The slots array is read at each call, as it is then."""

    def __init__(self, gate: QuantRows, up: QuantRows, slots, down: tuple, dst=None, n_out: int = 1):
        pairs, gu = _pairs_args(np.zeros(gate.n, np.float32), gate, up, slots, None)
        self._offsets, self._rows, self.k = pairs[:3], pairs[5:], gu.shape[0]  # (x and gu between)
        block, out = _block_args(np.zeros(self.k, np.float32), *down, dst, n_out)
        self._down, self._shape = block[2:], out.shape  # (h and out before)
        if dst is None:
            self._down += (None, 1)  # (dst and n_out given, for `fold`'s total after them)

    def __call__(self, x: np.ndarray, fold: bool = False) -> np.ndarray:
        """The partial sums [n_out, *lead, n]; fold: their sum [*lead, n], sum_rows' bit for bit, each added as it
        ends (a pass of many positions holds one partial sum at a time, not n_out)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        lead = x.shape[:-1]
        gu = np.empty((*lead, self.k, 2), dtype=np.float32)
        h = np.empty((*lead, self.k), dtype=np.float32)
        out = np.empty((*([] if fold else self._shape[:-1]), *lead, self._shape[-1]), dtype=np.float32)
        total = (np.empty_like(out),) if fold else ()
        _native.ffn_glu((*self._offsets, x, gu, *self._rows), (h, out, *self._down, *total))
        return total[0] if fold else out


def glu_pairs(gu: np.ndarray) -> np.ndarray:
    """silu(gu[..., 0]) * gu[..., 1] (float32 [..., k, 2] from row_dot_pairs), silu_mul's arithmetic."""
    h = np.empty(gu.shape[:-1], dtype=np.float32)
    _native.glu_pairs(gu, h)
    return h


def sum_rows(a: np.ndarray) -> np.ndarray:
    """a[0] + a[1] + ... (float32 [n, ...]) in row order: each element rounded as a loop of numpy additions."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty(a.shape[1:], dtype=np.float32)
    _native.sum_rows(a, out)
    return out


def row_axpy(c: np.ndarray, q: QuantRows, slots=None, dst=None, n_out: int = 1) -> np.ndarray:
    """float32 [..., n]: out[...] = sum_j c[..., j] W[slots[j]] (slots None: rows 0..k-1, or Addresses); c [k] or
    [m, k]. With dst: [n_out, ..., n], out[i] the sum over the rows j with dst[j] == i alone."""
    c = np.ascontiguousarray(c, dtype=np.float32)
    extra, shape = _dst(dst, n_out, (*c.shape[:-1], q.n))
    out = np.empty(shape, dtype=np.float32)
    _native.row_axpy(c, out, *q._args(_slots(slots), c.shape[-1]), *extra)
    return out


def silu_mul(g: np.ndarray, u: np.ndarray) -> None:
    """g = silu(g) * u in place (float32 rows of one length): a SwiGLU's hidden units."""
    _native.silu_mul(g, u)


def linear(q: "QuantRows", rows: int, interleaved: bool = False):
    """A native handle on `rows` rows of q (their buffers held while it lives), for `_native.attention`; interleaved:
    q's codes as `interleave` lays them out."""
    return _native.linear(
        q.w,
        q.w_off,
        q.w_stride,
        q.s,
        q.s_off,
        q.s_stride,
        q.b,
        q.b_off,
        q.b_stride,
        rows,
        q.n,
        q.bits,
        q.group_size,
        SCALE_TYPES[q.scale_dtype],
        q.symmetric,
        interleaved,
    )


def contiguous(*arrays) -> bool:
    """All row-major in memory (the kernels' assumption; MLX views such as column slices are not); None: absent."""
    return all(memoryview(a).c_contiguous for a in arrays if a is not None)


# float32 rows computed natively at once (a row's weights read once for all): a decode step or a verification pass
# of up to 32 drafts; prompts keep MLX / BLAS (float activations: perplexity figures stay MLX's arithmetic)
NATIVE_ROWS = 33


_HOST_PASS = contextvars.ContextVar("host_pass", default=False)


@contextmanager
def host_pass():
    """A pass of the native step (engine/native_step.py): products of any number of float32 rows natively, each row
    alone (an MoE block's router and experts over a prompt: MLX's CPU ops would compute them many times slower, and
    round by the rows)."""
    token = _HOST_PASS.set(True)
    try:
        yield
    finally:
        _HOST_PASS.reset(token)


def native_rows(rows: int) -> bool:
    """Whether the native kernels take a product of `rows` float32 rows: up to NATIVE_ROWS, any in a host pass."""
    return 0 < rows and (rows <= NATIVE_ROWS or _HOST_PASS.get())


def applies(x: mx.array, bits: int, group_size: int, n: int, scale_dtype) -> bool:
    """Whether the native path computes x's product: float32 rows (`native_rows`) on the CPU, supported weights."""
    return (
        x.dtype == mx.float32
        and native_rows(x.size // max(1, x.shape[-1]))
        and available()
        and supports(bits, group_size, n, scale_dtype)
    )


def matvec(
    x: mx.array, weight, scales, biases, group_size: int, bits: int, transpose: bool = True
) -> Optional[mx.array]:
    """mx.quantized_matmul(x, weight, scales, biases, transpose) for up to NATIVE_ROWS rows x, natively (biases
    None: symmetric); None when it does not apply (the caller then uses MLX's op)."""
    n = weight.shape[-1] * 32 // bits
    if x.shape[-1] != (n if transpose else weight.shape[0]) or not applies(x, bits, group_size, n, scales.dtype):
        return None
    if not contiguous(weight, scales, biases):
        return None
    q = QuantRows.of_matrix(weight, scales, biases, group_size, bits)
    xv = np.asarray(x).reshape(-1, x.shape[-1])
    y = row_dot(xv, q, k=weight.shape[0]) if transpose else row_axpy(xv, q)
    return mx.array(y).reshape(*x.shape[:-1], y.shape[-1])


DEQUANT_CHUNK_BYTES = 2 << 20  # float32 weights dequantised at a time for prompts (bounded temporaries)
DEQUANT_MIN_ROWS = (
    8  # below, dequantising costs more than MLX's kernel saves (benchmarks/cpu_facts.py: 16 rows 3x faster)
)


def quantized_matmul(
    x: mx.array, weight, scales, biases, group_size: int, bits: int, transpose: bool = True
) -> mx.array:
    """mx.quantized_matmul, faster on the CPU: up to NATIVE_ROWS float32 rows natively (`matvec`); more float32
    rows (long prompts) as OpenBLAS float32 matmuls of weights dequantised a chunk of rows at a time, which on this
    CPU is several times faster than MLX's quantised kernel (BENCHMARKS.md, "CPU kernels"); else MLX's op.
    biases None: symmetric (derived from the scales where an op needs them)."""
    y = matvec(x, weight, scales, biases, group_size, bits, transpose)
    if y is not None:
        return y
    if not (available() and x.dtype == mx.float32 and x.size >= DEQUANT_MIN_ROWS * x.shape[-1]):
        biases = symmetric_biases(scales, bits) if biases is None else biases
        return mx.quantized_matmul(x, weight, scales, biases, transpose=transpose, group_size=group_size, bits=bits)
    n = weight.shape[-1] * 32 // bits
    per = max(1, DEQUANT_CHUNK_BYTES // (4 * n))
    out = None
    for i in range(0, weight.shape[0], per):
        s = scales[i : i + per].astype(mx.float32)  # float16 would round
        b = symmetric_biases(s, bits) if biases is None else biases[i : i + per].astype(mx.float32)
        w = mx.dequantize(weight[i : i + per], s, b, group_size, bits)
        if transpose:  # x @ W^T: a chunk of output columns
            part = x @ w.T
            out = [part] if out is None else out + [part]
        else:  # x @ W: a chunk of the inner dimension
            part = x[..., i : i + per] @ w
            out = part if out is None else out + part
        mx.eval(part if transpose else out)  # one chunk's dequantised weights alive at a time
    return mx.concatenate(out, axis=-1) if transpose else out


# -- columns with block scales (convert --down-bits source) -----------------------------------------


def block_axpy(
    c: np.ndarray,
    codes,
    w_off: int,
    w_stride: int,
    slots,
    blocks,
    scales,
    biases,
    n: int,
    bits: int,
    dst=None,
    n_out: int = 1,
) -> np.ndarray:
    """float32 [..., n]: out[...] = sum_j c[..., j] W_j, W_j = scales[blocks[j]] * q_j + biases[blocks[j]], q_j the
    codes of row slots[j] (at codes[w_off + slots[j] * w_stride], packed like MLX's; or Addresses) and scales/biases
    [n_blocks, n] (biases None: symmetric); c [k] or [m, k]. dst, n_out: as `row_axpy` (a block's rows share theirs)."""
    args, out = _block_args(c, codes, w_off, w_stride, slots, blocks, scales, biases, n, bits, dst, n_out)
    _native.block_axpy(*args)
    return out


def _block_args(c, codes, w_off, w_stride, slots, blocks, scales, biases, n, bits, dst, n_out) -> tuple:
    """(the native block_axpy's arguments, their output)."""
    symmetric = biases is None
    biases = scales if symmetric else biases
    c = np.ascontiguousarray(c, dtype=np.float32)
    blocks = np.ascontiguousarray(blocks, dtype=np.int32).reshape(-1)
    extra, shape = _dst(dst, n_out, (*c.shape[:-1], n))
    out = np.empty(shape, dtype=np.float32)
    args = (c, out, codes, w_off, w_stride, _slots(slots), c.shape[-1], n, bits, blocks, scales, biases)
    return (*args, scales.shape[0], SCALE_TYPES[scales.dtype], symmetric, *extra), out


def block_applies(c: mx.array, n: int, bits: int, scales: mx.array) -> bool:
    """Whether `block_axpy` computes c's product: up to NATIVE_ROWS float32 rows on the CPU, 2/4/8-bit codes,
    n % 32 == 0."""
    return (
        c.dtype == mx.float32
        and 0 < c.size <= NATIVE_ROWS * c.shape[-1]
        and available()
        and bits in (2, 4, 8)
        and n % 32 == 0
        and scales.dtype in SCALE_TYPES
        and contiguous(scales)
    )


def block_matmul(
    c: mx.array, codes: mx.array, blocks: mx.array, scales: mx.array, biases: mx.array, bits: int
) -> mx.array:
    """c [..., k] @ W [k, n] with W_j = scales[blocks[j]] * q_j + biases[blocks[j]], q_j = codes[j] ([k, n * bits / 32]
    uint32; biases None: symmetric): one float32 row natively (`block_axpy`), else in MLX ops a chunk of rows at a
    time (bounded temporaries)."""
    n = codes.shape[-1] * 32 // bits
    if block_applies(c, n, bits, scales) and contiguous(codes):
        row = codes.shape[-1] * 4
        y = block_axpy(
            np.asarray(c).reshape(-1, c.shape[-1]), codes, 0, row, None, np.asarray(blocks), scales, biases, n, bits
        )
        return mx.array(y).reshape(*c.shape[:-1], n)
    per = max(1, DEQUANT_CHUNK_BYTES // (4 * n))
    out = None
    for i in range(0, codes.shape[0], per):
        w = block_dequantize(codes[i : i + per], blocks[i : i + per], scales, biases, bits, c.dtype)
        part = c[..., i : i + per] @ w
        out = part if out is None else out + part
        if codes.shape[0] > per:
            mx.eval(out)  # one chunk's weights alive at a time
    return out


# -- the model's quantised layers ------------------------------------------------------------------


def _layer_matvec(layer: nn.Module, x: mx.array) -> Optional[mx.array]:
    """x @ W^T for a quantised layer's weights, natively; None when it does not apply."""
    if getattr(layer, "mode", "affine") != "affine":
        return None
    return matvec(x, layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits)


def _derives_biases(layer: nn.Module) -> bool:
    """Symmetric codes stored without biases (format v4): the layer derives them from its scales."""
    return "biases" not in layer and getattr(layer, "mode", "affine") == "affine"


def _mlx_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """MLX's x @ W^T for a quantised layer (its bias not added)."""
    b = symmetric_biases(layer["scales"], layer.bits) if _derives_biases(layer) else layer.get("biases")
    return mx.quantized_matmul(
        x,
        layer["weight"],
        layer["scales"],
        b,
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose float32 products run as `quantized_matmul` above on the CPU."""

    def __call__(self, x):
        if getattr(self, "mode", "affine") != "affine":
            y = _mlx_matmul(self, x)
        else:
            y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


def interleaves(layer: nn.Module) -> bool:
    """Whether `interleave` applies to a quantised linear layer and the native loops read it faster so: 4-bit
    affine codes, rows of whole 64-byte chunks in groups of 4, on the AVX-512 int8 loops."""
    w = layer["weight"]
    return (
        type(layer) is QuantizedLinear
        and getattr(layer, "mode", "affine") == "affine"
        and layer.bits == 4
        and w.shape[0] % 4 == 0
        and w.shape[-1] % 16 == 0
        and int8_activations()
        and info().get("avx512", 0) == 1
    )


def interleave(w: mx.array) -> mx.array:
    """4-bit codes uint32 [k, n / 8] in 4-row groups, 64 bytes of each row in turn: the order in which the AVX-512
    loops read a group, one stream instead of four (`deinterleave` restores it)."""
    k, words = w.shape
    return w.reshape(k // 4, 4, words // 16, 16).transpose(0, 2, 1, 3).reshape(k, words)


def deinterleave(w: mx.array) -> mx.array:
    k, words = w.shape
    return w.reshape(k // 4, words // 16, 4, 16).transpose(0, 2, 1, 3).reshape(k, words)


class InterleavedLinear(QuantizedLinear):
    """A QuantizedLinear whose codes are held interleaved (`interleave`) for the native decode step; MLX's ops
    compute with them put back in rows, a temporary for each call (prompts through mlx-lm's forward)."""

    def __call__(self, x):
        y = quantized_matmul(
            x, deinterleave(self["weight"]), self["scales"], self.get("biases"), self.group_size, self.bits
        )
        return y + self["bias"] if "bias" in self else y


def interleave_layer(layer: QuantizedLinear) -> None:
    """Hold `layer`'s codes interleaved, in place (the rows' array released: the same memory as before)."""
    layer.weight = interleave(layer["weight"])
    mx.eval(layer.weight)
    layer.__class__ = InterleavedLinear


class QuantizedHead(nn.QuantizedLinear):
    """An untied LM head: up to NATIVE_ROWS rows natively (decode steps, verification passes), prompts as
    MLX's op. Not `QuantizedLinear`'s prompt path, which evaluates as it goes: mlx-lm discards a prompt's logits,
    and lazily they are never computed."""

    def __call__(self, x):
        y = _layer_matvec(self, x)
        y = _mlx_matmul(self, x) if y is None else y
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose as_linear (a tied LM head) runs natively for up to NATIVE_ROWS rows."""

    def __call__(self, x):
        if not _derives_biases(self):
            return super().__call__(x)
        s = self["scales"][x]
        return mx.dequantize(self["weight"][x], s, symmetric_biases(s, self.bits), self.group_size, self.bits)

    def as_linear(self, x):
        y = _layer_matvec(self, x)
        return _mlx_matmul(self, x) if y is None else y


def embeds(layer: nn.Module) -> bool:
    """Whether `embed` computes a quantised embedding's rows: affine 2, 4 or 8-bit codes, float16 or float32 scales
    (and biases alike)."""
    return (
        isinstance(layer, nn.QuantizedEmbedding)
        and getattr(layer, "mode", "affine") == "affine"
        and layer.bits in (2, 4, 8)
        and layer["scales"].dtype in (mx.float16, mx.float32)
        and layer.get("biases", layer["scales"]).dtype == layer["scales"].dtype
        and contiguous(layer["weight"], layer["scales"], layer.get("biases"))
    )


def embed(ids, layer: nn.Module) -> np.ndarray:
    """float32 [len(ids), n]: the rows `ids` of a quantised embedding (`embeds`), bit for bit MLX's dequantize of them
    (in one native call instead of MLX's ops and their evaluation)."""
    ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
    n = layer["weight"].shape[-1] * 32 // layer.bits
    out = np.empty((len(ids), n), dtype=np.float32)
    s = layer["scales"]
    _native.embed(
        ids, out, layer["weight"], s, layer.get("biases"), n, layer.bits, layer.group_size, SCALE_TYPES[s.dtype]
    )
    return out


def with_biases(model: nn.Module) -> nn.Module:
    """Give the layers that derive their biases (symmetric, stored without) the arrays, as mlx-lm's modules hold
    them (for code that reads them, such as mlx_lm.utils.dequantize_model). Returns the model."""
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and _derives_biases(m):
            m.biases = symmetric_biases(m["scales"], m.bits)
    return model


def patch(model: nn.Module) -> nn.Module:
    """Switch the model's quantised linear layers / embeddings to the classes above, in place (their
    weights and MLX's behaviour for everything else unchanged; symmetric layers stored without biases compute
    with derived ones). Returns the model."""
    for path, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:  # same data, one method more: no re-quantisation
            m.__class__ = QuantizedHead if path.split(".")[-1] == "lm_head" else QuantizedLinear
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = QuantizedEmbedding
    return model
