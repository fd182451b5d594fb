"""The FFN computed straight from neuron-cache rows: two primitives over a list of slots.

A per-layer cache is a uint8 mx.array `rows` [capacity, stride]; the stored row of
matrix `name` of the unit in slot s is component `<name>.weight` (float, or packed uint32
when quantised, with `<name>.scales` / `<name>.biases`) at its byte offset in rows[s]
(see flash_format.BundleLayout). With W_j the dequantised row of slot slots[j]:

    row_dot(x, ...)  [..., n_in] -> [..., k]:      out[..., j] = sum_i x[..., i] * W_j[i]
    row_axpy(w, ...) [..., k]    -> [..., n_out]:  out[..., :] = sum_j w[..., j] * W_j

so a GLU FFN over the active units is
    h = act(row_dot(x, rows, slots, layout, "gate", q)) * row_dot(x, rows, slots, layout, "up", q)
    y = row_axpy(h, rows, slots, layout, "down", q)
(ReLU: fc1 / fc2 likewise; the dip layout's gate/up rows are input columns, so they go
through row_axpy with the pruned input as weights).

Three implementations behind each function:
  * MLX ops (everywhere, and the reference): gather the component's columns of the active
    rows with mx.take, view them as their dtype, then matmul / mx.quantized_matmul in the
    dtype of the input.
  * native CPU (cpu_gemv.py, kernels/cpu_gemv.c), when MLX computes on the CPU: one float32
    row (decode) against 2/4/8-bit rows, read in place in the cache buffer like Metal's.
  * Metal (`mx.metal.is_available()`): kernels from kernels/gather_ffn.metal that read the
    active rows in place in the cache buffer (no gathered copy), dequantise 2/4/8-bit rows
    on the fly and accumulate in float32.
`use_metal=None` picks Metal when it is available and the layout suits it (component
offsets aligned to their element size), True insists (raising otherwise), False never.
"""

import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .flash_format import _DTYPES, BundleLayout, Component
from . import cpu_gemv, kernel_source
from .kernel_source import KERNEL_DIRS, split_sections

KERNEL_FILE = "gather_ffn.metal"

_FLOATS = (mx.float16, mx.bfloat16, mx.float32)
_ROW_DOT_THREADGROUP = 256  # 8 simdgroups, one output each
_AXPY_TC, _AXPY_TJ = 32, 8  # row_axpy threadgroup: 32 column threads x 8 partial sums over j


# -- kernel sources ------------------------------------------------------------------


def kernel_path() -> Optional[Path]:
    """The gather_ffn.metal that the kernels are built from (None if it is not installed)."""
    return kernel_source.kernel_path(KERNEL_FILE)


def _build_kernels():
    path = kernel_path()
    if path is None:
        return None, None, None
    src = split_sections(path.read_text())
    row_dot = mx.fast.metal_kernel(
        name="gather_ffn_row_dot",
        input_names=["x", "rows", "slots"],
        output_names=["out"],
        source=src["row_dot"],
        header=src["header"],
    )
    row_axpy = mx.fast.metal_kernel(
        name="gather_ffn_row_axpy",
        input_names=["w", "rows", "slots"],
        output_names=["out"],
        source=src["row_axpy"],
        header=src["header"],
    )
    return row_dot, row_axpy, src


# Built once at import (building needs no Metal; only calling does).
_row_dot_kernel, _row_axpy_kernel, KERNEL_SOURCES = _build_kernels()


def metal_available() -> bool:
    """True when the Metal kernels can run here (Metal present and gather_ffn.metal found)."""
    return mx.metal.is_available() and _row_dot_kernel is not None


# -- the matrix inside a row ---------------------------------------------------------


@dataclass(frozen=True)
class RowMatrix:
    """Where matrix `name` lives in a cache row, and what it holds."""

    name: str
    weight: Component
    scales: Optional[Component]
    biases: Optional[Component]
    n: int  # logical row length (dequantised)
    bits: int  # 0: float rows
    group_size: int
    symmetric: bool = False  # no biases component: bias = -2^(bits-1) * scale

    @property
    def float_dtype(self) -> mx.Dtype:
        """The stored float type: the weights, or the scales/biases when quantised."""
        return _DTYPES[(self.scales or self.weight).dtype]

    @property
    def metal_ok(self) -> bool:
        """Whether the Metal kernels can read it: offsets aligned to the element size, bits 2/4/8."""
        if self.symmetric:  # the kernels read stored biases
            return False
        comps = [self.weight] + ([self.scales, self.biases] if self.bits else [])
        aligned = all(c.offset % _DTYPES[c.dtype].size == 0 for c in comps)
        return aligned and self.bits in (0, 2, 4, 8) and (self.bits == 0 or self.group_size % (32 // self.bits) == 0)


@lru_cache(maxsize=256)
def row_matrix(layout: BundleLayout, name: str, bits: Optional[int] = None, group_size: Optional[int] = None,
               symmetric: bool = False) -> RowMatrix:
    """Resolve matrix `name` ("gate", "fc1", ...) of `layout` for quantisation (bits, group_size[, symmetric: no
    biases stored]) or float (None)."""
    comps = {c.name: c for c in layout.components}
    weight = comps.get(f"{name}.weight")
    if weight is None:
        have = sorted({c.name.rsplit(".", 1)[0] for c in layout.components})
        raise ValueError(f"the layout has no matrix {name!r} (it has {', '.join(have)})")
    if len(weight.shape) != 1:
        raise ValueError(f"{name}.weight: expected one row per unit, got per-unit shape {weight.shape}")
    if bits is None:
        if weight.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"{name}.weight is {weight.dtype}: quantised rows need quant={{'bits', 'group_size'}}")
        return RowMatrix(name, weight, None, None, weight.shape[0], 0, 1)
    scales, biases = comps.get(f"{name}.scales"), comps.get(f"{name}.biases")
    if symmetric:
        biases = scales
    if weight.dtype != "uint32" or scales is None or biases is None:
        raise ValueError(f"{name}: quant={{'bits': {bits}, ...}} but the layout does not hold quantised rows of it")
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"{name}: unsupported bits {bits}")
    n = weight.shape[0] * 32 // bits
    if scales.shape != biases.shape or scales.shape[0] * group_size != n or scales.dtype != biases.dtype:
        raise ValueError(
            f"{name}: {n} values need {n // group_size} groups of {group_size}, "
            f"scales/biases have {scales.shape}/{biases.shape}"
        )
    return RowMatrix(name, weight, scales, None if symmetric else biases, n, bits, group_size, symmetric)


def _matrix(layout, name, quant) -> RowMatrix:
    if quant is None:
        return row_matrix(layout, name)
    return row_matrix(layout, name, int(quant["bits"]), int(quant["group_size"]), bool(quant.get("symmetric")))


# -- the MLX-ops path ----------------------------------------------------------------

_WORDS = (mx.uint32, mx.uint16, mx.uint8)


def _gather(rows: mx.array, slots: mx.array, c: Component) -> mx.array:
    """Component `c` of rows[slots] as [k, *c.shape] of its dtype.

    The gather reads the cache viewed as the widest word that divides the component's
    offset and size (and the stride): MLX's take copies element by element, so uint32
    words are ~3x faster than bytes; the result is viewed as the component's dtype.
    """
    stride = rows.shape[1]
    word = next(w for w in _WORDS if c.offset % w.size == 0 and c.nbytes % w.size == 0 and stride % w.size == 0)
    table = rows if word == mx.uint8 else mx.view(rows, word)
    lo = c.offset // word.size
    sub = mx.take(table[:, lo : lo + c.nbytes // word.size], slots, axis=0)
    dtype = _DTYPES[c.dtype]
    if dtype != word:
        sub = mx.view(sub, dtype)
    return sub.reshape(slots.shape[0], *c.shape)


def _ops_row_dot(x, rows, slots, m: RowMatrix):
    w = _gather(rows, slots, m.weight)
    if not m.bits:
        return x @ w.astype(x.dtype).T
    s, b = _scales_biases(rows, slots, m, x.dtype)
    return cpu_gemv.quantized_matmul(x, w, s, b, m.group_size, m.bits, transpose=True)


def _ops_row_axpy(w, rows, slots, m: RowMatrix):
    wt = _gather(rows, slots, m.weight)
    if not m.bits:
        return w @ wt.astype(w.dtype)
    s, b = _scales_biases(rows, slots, m, w.dtype)
    return cpu_gemv.quantized_matmul(w, wt, s, b, m.group_size, m.bits, transpose=False)


def _scales_biases(rows, slots, m: RowMatrix, dtype):
    s = _gather(rows, slots, m.scales).astype(dtype)
    b = cpu_gemv.symmetric_biases(s, m.bits) if m.symmetric else _gather(rows, slots, m.biases).astype(dtype)
    return s, b


# -- the native CPU path ----------------------------------------------------------------


def _cpu_ok(v: mx.array, rows: mx.array, m: RowMatrix) -> bool:
    return m.bits > 0 and cpu_gemv.applies(v, m.bits, m.group_size, m.n, m.float_dtype) and cpu_gemv.contiguous(rows)


def _cpu_rows(rows: mx.array, m: RowMatrix) -> cpu_gemv.QuantRows:
    stride = rows.shape[1]
    b = m.scales if m.symmetric else m.biases  # (ignored when symmetric)
    return cpu_gemv.QuantRows(rows, m.weight.offset, stride, rows, m.scales.offset, stride, rows, b.offset,
                              stride, m.n, m.bits, m.group_size, m.float_dtype, m.symmetric)


# -- the Metal path ------------------------------------------------------------------


def _template(m: RowMatrix, out_dtype) -> list:
    return [
        ("T", m.float_dtype),
        ("TO", out_dtype),
        ("N", m.n),
        ("BITS", m.bits),
        ("GS", m.group_size),
        ("W_OFF", m.weight.offset),
        ("S_OFF", m.scales.offset if m.bits else 0),
        ("B_OFF", m.biases.offset if m.bits else 0),
    ]


def _metal_row_dot(x2, rows, slots, m: RowMatrix):
    B, k = x2.shape[0], slots.shape[0]
    return _row_dot_kernel(
        inputs=[x2, rows, slots],
        template=_template(m, x2.dtype),
        grid=(32 * k, B, 1),
        threadgroup=(_ROW_DOT_THREADGROUP, 1, 1),
        output_shapes=[(B, k)],
        output_dtypes=[x2.dtype],
    )[0]


def _metal_row_axpy(w2, rows, slots, m: RowMatrix):
    B = w2.shape[0]
    columns = m.n // (32 // m.bits if m.bits else 1)  # one thread column per packed word
    groups = -(-columns // _AXPY_TC)
    return _row_axpy_kernel(
        inputs=[w2, rows, slots],
        template=_template(m, w2.dtype) + [("TC", _AXPY_TC), ("TJ", _AXPY_TJ)],
        grid=(groups * _AXPY_TC, _AXPY_TJ, B),
        threadgroup=(_AXPY_TC, _AXPY_TJ, 1),
        output_shapes=[(B, m.n)],
        output_dtypes=[w2.dtype],
    )[0]


# -- the API ---------------------------------------------------------------------------


def _check(a, rows, slots, what):
    if a.dtype not in _FLOATS:
        raise TypeError(f"{what} must be float16, bfloat16 or float32, got {a.dtype}")
    if rows.ndim != 2 or rows.dtype != mx.uint8:
        raise ValueError(f"rows must be uint8 [capacity, stride], got {rows.dtype} {rows.shape}")
    if not isinstance(slots, mx.array):
        slots = mx.array(np.asarray(slots, dtype=np.int32).reshape(-1))
    if slots.ndim != 1:
        raise ValueError(f"slots must be 1-D, got shape {slots.shape}")
    return slots if slots.dtype == mx.int32 else slots.astype(mx.int32)


def _use_metal(use_metal, m: RowMatrix) -> bool:
    if use_metal is None:
        if _row_dot_kernel is None and mx.metal.is_available():
            warnings.warn(f"gather_ffn: {KERNEL_FILE} not found in {', '.join(map(str, KERNEL_DIRS))}: "
                          "using the slower MLX-ops path (reinstall mlx_flash)", stacklevel=3)
        return metal_available() and m.metal_ok
    if use_metal:
        if not metal_available():
            why = "Metal not available (Apple silicon only)" if _row_dot_kernel is not None else (
                f"{KERNEL_FILE} not found in {', '.join(map(str, KERNEL_DIRS))}")
            raise RuntimeError(f"gather_ffn: use_metal=True but {why}")
        if not m.metal_ok:
            raise ValueError(f"gather_ffn: the Metal kernels cannot read {m.name} (unaligned offsets or {m.bits}-bit rows)")
    return bool(use_metal)


def row_dot(x: mx.array, rows: mx.array, slots, layout: BundleLayout, name: str, quant: Optional[dict], use_metal=None) -> mx.array:
    """Dot products of x with the rows of matrix `name` in cache slots `slots`.

    x [..., n_in] float16/bfloat16/float32; rows uint8 [capacity, stride]; slots int32 [k]
    (any order, repeats allowed, each in [0, capacity)); layout the rows' BundleLayout;
    quant None (float rows) or {"bits", "group_size"} (MLX affine). Returns [..., k] in x's dtype:

        out[..., j] = sum_i x[..., i] * W_j[i],   W_j = dequantised `name` row of rows[slots[j]]

    i.e. x @ W[slots]^T for row-stored matrices (gate, up, fc1). Computed in x's dtype by the
    MLX-ops path, accumulated in float32 by the Metal kernel.
    """
    slots = _check(x, rows, slots, "x")
    m = _matrix(layout, name, quant)
    if x.shape[-1] != m.n:
        raise ValueError(f"row_dot: x has {x.shape[-1]} features, {name} rows hold {m.n}")
    lead, k = x.shape[:-1], slots.shape[0]
    if k == 0 or 0 in lead:  # (quantized_matmul crashes on empty operands)
        return mx.zeros((*lead, k), dtype=x.dtype)
    if _use_metal(use_metal, m):
        return _metal_row_dot(x.reshape(-1, m.n), rows, slots, m).reshape(*lead, k)
    if _cpu_ok(x, rows, m):
        return mx.array(cpu_gemv.row_dot(np.asarray(x), _cpu_rows(rows, m), np.asarray(slots))).reshape(*lead, k)
    return _ops_row_dot(x, rows, slots, m)


def row_axpy(w: mx.array, rows: mx.array, slots, layout: BundleLayout, name: str, quant: Optional[dict], use_metal=None) -> mx.array:
    """The rows of matrix `name` in cache slots `slots`, weighted by w and summed.

    w [..., k] float16/bfloat16/float32 (k = len(slots)); rows, slots, layout, quant as in
    row_dot. Returns [..., n_out] in w's dtype:

        out[..., :] = sum_j w[..., j] * W_j,   W_j = dequantised `name` row of rows[slots[j]]

    i.e. w @ W[slots] for column-stored matrices (down, fc2, and the dip layout's gate/up).
    """
    slots = _check(w, rows, slots, "w")
    m = _matrix(layout, name, quant)
    lead, k = w.shape[:-1], slots.shape[0]
    if w.shape[-1] != k:
        raise ValueError(f"row_axpy: w has {w.shape[-1]} weights per row for {k} slots")
    if k == 0 or 0 in lead:
        return mx.zeros((*lead, m.n), dtype=w.dtype)
    if _use_metal(use_metal, m):
        return _metal_row_axpy(w.reshape(-1, k), rows, slots, m).reshape(*lead, m.n)
    if _cpu_ok(w, rows, m):
        return mx.array(cpu_gemv.row_axpy(np.asarray(w), _cpu_rows(rows, m), np.asarray(slots))).reshape(*lead, m.n)
    return _ops_row_axpy(w, rows, slots, m)


def block_row_axpy(w: mx.array, rows: mx.array, slots, layout: BundleLayout, name: str, quant: dict, units,
                   scales: mx.array, biases: mx.array) -> mx.array:
    """`row_axpy` for rows that hold only the source's codes of matrix `name` (quantisation
    "resident_scales", convert --down-bits source): unit units[j] (in slot slots[j]) is in group
    units[j] // group_size, whose scales/biases [n_out] are rows of the resident tables. Natively for one
    float32 row on the CPU, else MLX ops (also on Metal: no kernel of its own yet). biases None: symmetric."""
    slots = _check(w, rows, slots, "w")
    codes = layout.component(f"{name}.weight")
    bits = int(quant["bits"])
    n = codes.shape[0] * 32 // bits
    blocks = np.asarray(units, dtype=np.int32) // int(quant["group_size"])
    lead, k = w.shape[:-1], slots.shape[0]
    if w.shape[-1] != k or len(blocks) != k:
        raise ValueError(f"block_row_axpy: w has {w.shape[-1]} weights per row, {len(blocks)} units for {k} slots")
    if k == 0 or 0 in lead:
        return mx.zeros((*lead, n), dtype=w.dtype)
    if cpu_gemv.block_applies(w, n, bits, scales) and cpu_gemv.contiguous(rows):
        y = cpu_gemv.block_axpy(np.asarray(w), rows, codes.offset, rows.shape[1], np.asarray(slots), blocks, scales,
                                biases, n, bits)
        return mx.array(y).reshape(*lead, n)
    return cpu_gemv.block_matmul(w, _gather(rows, slots, codes), mx.array(blocks), scales, biases, bits)
