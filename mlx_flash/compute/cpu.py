"""The native CPU backend (kernels/cpu_gemv.c through cpu_gemv.py), when MLX computes on the CPU: one
float32 row (a decode step) against 2/4/8-bit rows read in place in the cache buffer.

A decode step's layer input becomes a numpy row once (`prepare`: the layer's one synchronisation) and
stays one until `finish`; the kernels run eagerly with the GIL released, so the pool's reads of the
misses go on meanwhile. Prompts (several rows) take the MLX-ops path it inherits.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..format.layout import RowMatrix
from . import cpu_gemv
from .ffn import ACTIVATIONS, glu
from .ops import OpsBackend
from .rows import RowSet, slots_array


def supports(m: RowMatrix) -> bool:
    """Whether the kernels compute with matrix m's rows."""
    return m.bits > 0 and cpu_gemv.supports(m.bits, m.group_size, m.n, m.float_dtype)


def _quant_rows(rows: mx.array, m: RowMatrix) -> cpu_gemv.QuantRows:
    stride = rows.shape[1]
    b = m.scales if m.symmetric else m.biases  # (ignored when symmetric)
    return cpu_gemv.QuantRows(
        rows,
        m.weight.offset,
        stride,
        rows,
        m.scales.offset,
        stride,
        rows,
        b.offset,
        stride,
        m.n,
        m.bits,
        m.group_size,
        m.float_dtype,
        m.symmetric,
    )


def _native(rows, slots):
    """(a buffer of the rows, the kernels' slots argument): rows[slots], or a RowSet's rows by address."""
    if isinstance(rows, RowSet):
        return rows.parts[0], cpu_gemv.Addresses(rows.addresses())
    if not cpu_gemv.contiguous(rows):  # (a strided view: the kernels read rows a stride apart)
        raise ValueError("the native kernels read C-contiguous rows")
    return rows, slots_array(slots)


class CpuBackend(OpsBackend):
    name = "cpu"

    def prepare(self, x: mx.array):
        if x.dtype == mx.float32 and x.size == x.shape[-1]:
            return np.array(x.reshape(-1))
        return x  # a prompt: MLX ops

    def host(self, x) -> np.ndarray:
        return x.reshape(-1, x.shape[-1]) if isinstance(x, np.ndarray) else super().host(x)

    def finish(self, y, like: mx.array) -> mx.array:
        if not isinstance(y, np.ndarray):
            return super().finish(y, like)
        return mx.array(y).reshape(*like.shape[:-1], y.shape[-1]).astype(like.dtype)

    def take(self, v: mx.array, units: np.ndarray, like):
        return np.asarray(v.astype(mx.float32))[units] if isinstance(like, np.ndarray) else super().take(v, units, like)

    def index(self, v, idx: np.ndarray):
        return v[..., idx] if isinstance(v, np.ndarray) else super().index(v, idx)

    def zeros(self, x):
        return np.zeros_like(x) if isinstance(x, np.ndarray) else super().zeros(x)

    def _masked(self, h, mask):
        if isinstance(h, np.ndarray) and mask is not None:
            return h * mask.reshape(h.shape)
        return super()._masked(h, mask)

    def input_columns(self, w, rows, slots):
        if not isinstance(w, np.ndarray):
            return super().input_columns(w, rows, slots)
        return np.stack([self.row_axpy(w, rows, slots, name) for name in ("gate", "up")])

    # the activations on the host row: SiLU natively, the others by MLX
    def activation(self, h):
        if not isinstance(h, np.ndarray):
            return super().activation(h)
        return np.asarray(ACTIVATIONS[self.ffn["activation"]](mx.array(h)))

    def glu(self, g, u):
        if not isinstance(g, np.ndarray):
            return super().glu(g, u)
        if self.ffn["activation"] == "silu":  # natively, in place (g is this step's own output)
            cpu_gemv.silu_mul(g, u)
            return g
        return np.asarray(glu(mx.array(g), mx.array(u), self.ffn["activation"]))

    def gate_up(self, x, rows, slots):
        if not isinstance(x, np.ndarray) or self.ffn["activation"] != "silu":
            return super().gate_up(x, rows, slots)
        buf, at = _native(rows, slots)  # each unit's gate and up rows side by side, in one pass
        gate, up = (_quant_rows(buf, self.matrix(name)) for name in ("gate", "up"))
        return cpu_gemv.glu_pairs(cpu_gemv.row_dot_pairs(x, gate, up, at))

    def in_place(self, x) -> bool:
        return isinstance(x, np.ndarray)  # (the kernels' rows: cache rows and read buffers, C-contiguous)

    def row_dot(self, x, rows, slots, name: str):
        if not isinstance(x, np.ndarray):
            return super().row_dot(x, rows, slots, name)
        buf, at = _native(rows, slots)
        return cpu_gemv.row_dot(x, _quant_rows(buf, self.matrix(name)), at)

    def row_axpy(self, w, rows, slots, name: str, dst=None, n_out: int = 1):
        if not isinstance(w, np.ndarray):
            return super().row_axpy(w, rows, slots, name)
        buf, at = _native(rows, slots)
        return cpu_gemv.row_axpy(w, _quant_rows(buf, self.matrix(name)), at, dst, n_out)

    def block_row_axpy(
        self, w, rows, slots, name: str, units, scales: mx.array, biases: Optional[mx.array], dst=None, n_out: int = 1
    ):
        if not isinstance(w, np.ndarray):
            return super().block_row_axpy(w, rows, slots, name, units, scales, biases)
        return cpu_gemv.block_axpy(w, *self._block_args(rows, slots, name, units, scales, biases), dst, n_out)

    def _block_args(self, rows, slots, name: str, units, scales: mx.array, biases: Optional[mx.array]) -> tuple:
        """cpu_gemv.block_axpy's arguments after the coefficients and before dst, for the `name` rows of units."""
        if not (cpu_gemv.contiguous(scales) and scales.dtype in cpu_gemv.SCALE_TYPES):
            raise ValueError("the native backend needs contiguous resident scales of a supported type")
        q = self.quant[name]
        codes = self.layout.component(f"{name}.weight")
        bits = int(q["bits"])
        blocks = np.asarray(units, dtype=np.int32) // int(q["group_size"])
        buf, at = _native(rows, slots)
        return buf, codes.offset, buf.shape[1], at, blocks, scales, biases, codes.shape[0] * 32 // bits, bits

    def units(self, x, rows, slots, units, resident, mask=None, dst=None, n_out: int = 1):
        if isinstance(x, np.ndarray) and mask is None and self.fused():
            return self.bind_units(rows, slots, units, resident, dst, n_out)(x)
        return super().units(x, rows, slots, units, resident, mask, dst, n_out)

    def fused(self) -> bool:
        """Whether host rows' units are one cpu_gemv.ffn_glu call: a SiLU GLU whose down codes have resident
        scales."""
        q = self.quant.get("down")
        return self.ffn["kind"] == "glu" and self.ffn["activation"] == "silu" and bool(q and q.get("resident_scales"))

    def bind_units(self, rows, slots, units, resident, dst=None, n_out: int = 1):
        if not self.fused():
            return super().bind_units(rows, slots, units, resident, dst, n_out)
        # gate, up, the GLU and down in one call: a row's units read once, whole
        buf, at = _native(rows, slots)
        gate, up = (_quant_rows(buf, self.matrix(name)) for name in ("gate", "up"))
        down = self._block_args(rows, slots, "down", units, resident["down.scales"], resident.get("down.biases"))
        return cpu_gemv.FfnGlu(gate, up, at, down, dst, n_out)
