"""The Metal backend (`mx.metal.is_available()`): kernels from kernels/gather_ffn.metal read the active rows
in place in the cache buffer (no gathered copy), dequantise 2/4/8-bit rows on the fly and accumulate in
float32. Rows of the source's codes with resident group scales have no kernel yet: MLX ops."""

from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..format.layout import DTYPES, RowMatrix
from ..io import kernel_source
from ..io.kernel_source import split_sections
from .ops import OpsBackend

KERNEL_FILE = "gather_ffn.metal"

_ROW_DOT_THREADGROUP = 256  # 8 simdgroups, one output each
_AXPY_TC, _AXPY_TJ = 32, 8  # row_axpy threadgroup: 32 column threads x 8 partial sums over j


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


def available() -> bool:
    """True when the Metal kernels can run here (Metal present and gather_ffn.metal found)."""
    return mx.metal.is_available() and _row_dot_kernel is not None


def supports(m: RowMatrix) -> bool:
    """Whether the kernels can read m: offsets aligned to the element size, bits 0/2/4/8, stored biases."""
    if m.symmetric:  # the kernels read stored biases
        return False
    comps = [m.weight] + ([m.scales, m.biases] if m.bits else [])
    aligned = all(c.offset % DTYPES[c.dtype].size == 0 for c in comps)
    return aligned and m.bits in (0, 2, 4, 8) and (m.bits == 0 or m.group_size % (32 // m.bits) == 0)


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


class MetalBackend(OpsBackend):
    name = "metal"

    def row_dot(self, x, rows, slots, name: str):
        m, slots = self.matrix(name), mx.array(slots)
        x2 = x.reshape(-1, m.n)
        B, k = x2.shape[0], slots.shape[0]
        out = _row_dot_kernel(
            inputs=[x2, rows, slots],
            template=_template(m, x2.dtype),
            grid=(32 * k, B, 1),
            threadgroup=(_ROW_DOT_THREADGROUP, 1, 1),
            output_shapes=[(B, k)],
            output_dtypes=[x2.dtype],
        )[0]
        return out.reshape(*x.shape[:-1], k)

    def row_axpy(self, w, rows, slots, name: str, dst=None, n_out: int = 1):
        m, slots = self.matrix(name), mx.array(slots)
        k = slots.shape[0]
        w2 = w.reshape(-1, k)
        B = w2.shape[0]
        columns = m.n // (32 // m.bits if m.bits else 1)  # one thread column per packed word
        groups = -(-columns // _AXPY_TC)
        out = _row_axpy_kernel(
            inputs=[w2, rows, slots],
            template=_template(m, w2.dtype) + [("TC", _AXPY_TC), ("TJ", _AXPY_TJ)],
            grid=(groups * _AXPY_TC, _AXPY_TJ, B),
            threadgroup=(_AXPY_TC, _AXPY_TJ, 1),
            output_shapes=[(B, m.n)],
            output_dtypes=[w2.dtype],
        )[0]
        return out.reshape(*w.shape[:-1], m.n)
