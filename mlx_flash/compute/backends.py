"""The FFN of a set of cache rows, on one backend chosen once per layout.

    ops    MLX ops (everywhere; the reference, and prompts)        compute/ops.py
    cpu    native kernels on one float32 row, MLX on the CPU         compute/cpu.py
    metal  kernels reading the rows in place, on Apple silicon       compute/metal.py

Each backend has the same methods (OpsBackend's): `prepare` (the layer input in the backend's form),
`units` (the FFN over some cache rows: the formula is written once, in ops.py), `row_dot` / `row_axpy` /
`block_row_axpy` (the products it is made of), `sync`, `finish`. With W_j the dequantised row of slot slots[j]:

    row_dot(x)  [..., n_in] -> [..., k]:      out[..., j] = sum_i x[..., i] * W_j[i]   (gate, up, fc1)
    row_axpy(w) [..., k]    -> [..., n_out]:  out[..., :] = sum_j w[..., j] * W_j      (down, fc2; dip's gate/up)

`row_dot` / `row_axpy` / `block_row_axpy` below are the same products for one call (tests, benchmarks).
"""

import warnings
from typing import Optional

import mlx.core as mx
import numpy as np

from ..format.layout import BundleLayout, matrix
from . import cpu, cpu_gemv, metal
from .cpu import CpuBackend
from .metal import MetalBackend
from .ops import OpsBackend
from .rows import check_float, check_rows, slots_array

__all__ = ["backend_for", "OpsBackend", "CpuBackend", "MetalBackend", "row_dot", "row_axpy", "block_row_axpy"]


def _supported(layout: BundleLayout, ffn: dict):
    """{"metal": .., "cpu": ..}: whether each backend's kernels read every matrix whose rows this layout holds."""
    names = {c.name.rsplit(".", 1)[0] for c in layout.components}
    ok = {"metal": True, "cpu": True}
    for name, info in ffn["matrices"].items():
        q = info["quantization"]
        if name not in names:
            continue
        if q and q.get("resident_scales"):  # the source's codes, group scales resident: no Metal kernel (ops)
            n = layout.component(f"{name}.weight").shape[0] * 32 // int(q["bits"])
            ok["cpu"] &= int(q["bits"]) in (2, 4, 8) and n % 32 == 0
            continue
        m = matrix(layout, name, q)
        ok["metal"] &= metal.supports(m)
        ok["cpu"] &= cpu.supports(m)
    return ok


def backend_for(layout: BundleLayout, ffn: dict, use_metal: Optional[bool] = None) -> OpsBackend:
    """The backend for cache rows of `layout` (`ffn`: the manifest's ffn section, its matrices' quantisation).

    use_metal None: Metal when it is available and its kernels read every matrix, else the native CPU
    kernels when MLX computes on the CPU and they read every matrix, else MLX ops; True insists on Metal
    (raising otherwise); False never uses it."""
    ok = _supported(layout, ffn)
    if use_metal:
        if not metal.available():
            why = (
                "Metal not available (Apple silicon only)"
                if metal.KERNEL_SOURCES is not None
                else (f"{metal.KERNEL_FILE} not found in {', '.join(map(str, metal.kernel_source.KERNEL_DIRS))}")
            )
            raise RuntimeError(f"compute: use_metal=True but {why}")
        if not ok["metal"]:
            raise ValueError(
                "compute: the Metal kernels cannot read these rows (symmetric, unaligned offsets, or not 2/4/8-bit)"
            )
        return MetalBackend(layout, ffn)
    if use_metal is None:
        if metal.KERNEL_SOURCES is None and mx.metal.is_available():
            warnings.warn(
                f"compute: {metal.KERNEL_FILE} not found: using the slower MLX-ops path (reinstall mlx_flash)",
                stacklevel=2,
            )
        if metal.available() and ok["metal"]:
            return MetalBackend(layout, ffn)
    if cpu_gemv.available() and ok["cpu"]:
        return CpuBackend(layout, ffn)
    return OpsBackend(layout, ffn)


# -- one product per call ---------------------------------------------------------------------


def _one(layout, name, quant, use_metal, a, rows, slots, what):
    check_float(a, what)
    check_rows(rows)
    slots = slots_array(slots)
    return backend_for(layout, {"matrices": {name: {"quantization": quant}}}, use_metal), slots


def row_dot(
    x: mx.array, rows: mx.array, slots, layout: BundleLayout, name: str, quant: Optional[dict], use_metal=None
) -> mx.array:
    """x [..., n_in] (float16/bfloat16/float32) @ W[slots]^T for matrix `name` of the rows' layout (quant None:
    float rows, or {"bits", "group_size"[, "symmetric"]}): [..., k] in x's dtype."""
    b, slots = _one(layout, name, quant, use_metal, x, rows, slots, "x")
    n = b.matrix(name).n
    if x.shape[-1] != n:
        raise ValueError(f"row_dot: x has {x.shape[-1]} features, {name} rows hold {n}")
    if len(slots) == 0 or 0 in x.shape[:-1]:  # (quantized_matmul crashes on empty operands)
        return mx.zeros((*x.shape[:-1], len(slots)), dtype=x.dtype)
    return b.finish(b.row_dot(b.prepare(x), rows, slots, name), x)


def row_axpy(
    w: mx.array, rows: mx.array, slots, layout: BundleLayout, name: str, quant: Optional[dict], use_metal=None
) -> mx.array:
    """w [..., k] @ W[slots] for matrix `name` (k = len(slots)): [..., n_out] in w's dtype."""
    b, slots = _one(layout, name, quant, use_metal, w, rows, slots, "w")
    if w.shape[-1] != len(slots):
        raise ValueError(f"row_axpy: w has {w.shape[-1]} weights per row for {len(slots)} slots")
    if len(slots) == 0 or 0 in w.shape[:-1]:
        return mx.zeros((*w.shape[:-1], b.matrix(name).n), dtype=w.dtype)
    return b.finish(b.row_axpy(b.prepare(w), rows, slots, name), w)


def block_row_axpy(
    w: mx.array,
    rows: mx.array,
    slots,
    layout: BundleLayout,
    name: str,
    quant: dict,
    units,
    scales: mx.array,
    biases: Optional[mx.array],
) -> mx.array:
    """`row_axpy` for rows holding only the source's codes of `name` (quantisation "resident_scales"): unit
    units[j] (in slot slots[j]) is in group units[j] // group_size, whose scales/biases [n_out] are rows of the
    resident tables. biases None: symmetric."""
    b, slots = _one(layout, name, quant, False, w, rows, slots, "w")
    codes = layout.component(f"{name}.weight")
    n = codes.shape[0] * 32 // int(quant["bits"])
    if w.shape[-1] != len(slots) or len(units) != len(slots):
        raise ValueError(
            f"block_row_axpy: w has {w.shape[-1]} weights per row, {len(units)} units for {len(slots)} slots"
        )
    if len(slots) == 0 or 0 in w.shape[:-1]:
        return mx.zeros((*w.shape[:-1], n), dtype=w.dtype)
    return b.finish(b.block_row_axpy(b.prepare(w), rows, slots, name, np.asarray(units), scales, biases), w)
