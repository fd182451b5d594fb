"""The MLX-ops backend, everywhere and the reference: gather the component's columns of the active rows
with mx.take, view them as their dtype, then matmul / quantised matmul in the input's dtype.

`OpsBackend.units` holds the FFN formula over a set of cache rows, which every backend shares:

    glu:  y = sum_j down_j * glu(gate_j . x, up_j . x)
    relu: y = sum_j fc2_j * act(fc1_j . x + b1_j)

Backends differ in `row_dot` / `row_axpy` / `block_row_axpy` and in the form of the layer input
they compute on (`prepare`): here an mx.array, lazily (the engine's one synchronisation per layer is
the host copy its selector reads).
"""

from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ..format.layout import DTYPES, BundleLayout, Component, RowMatrix, matrix
from ..format.quant import symmetric_biases
from . import cpu_gemv
from .ffn import ACTIVATIONS, glu
from .rows import RowSet, per_partial

_WORDS = (mx.uint32, mx.uint16, mx.uint8)


def gather(rows: mx.array, slots: mx.array, c: Component) -> mx.array:
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
    dtype = DTYPES[c.dtype]
    if dtype != word:
        sub = mx.view(sub, dtype)
    return sub.reshape(slots.shape[0], *c.shape)


def _scales_biases(rows, slots, m: RowMatrix, dtype):
    s = gather(rows, slots, m.scales).astype(dtype)
    b = symmetric_biases(s, m.bits) if m.symmetric else gather(rows, slots, m.biases).astype(dtype)
    return s, b


class OpsBackend:
    """The FFN of cache rows of one layout (`layout`, the manifest's `ffn` section) in MLX ops."""

    name = "ops"

    def __init__(self, layout: BundleLayout, ffn: dict):
        self.layout, self.ffn = layout, ffn
        self.quant = {name: m["quantization"] for name, m in ffn["matrices"].items()}

    # -- the form of the layer input --------------------------------------------------------
    def prepare(self, x: mx.array):
        """The layer input in this backend's form."""
        return x

    def host(self, x) -> np.ndarray:
        """The layer input on the host, float32 [tokens, d], for selectors (evaluates it)."""
        return np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32))

    def sync(self, y) -> None:
        """Compute y now (before the scratch rows it reads are overwritten)."""
        mx.eval(y)

    def finish(self, y, like: mx.array) -> mx.array:
        """y as an mx.array of `like`'s dtype."""
        return y.astype(like.dtype)

    def take(self, v: mx.array, units: np.ndarray, like):
        """v[units] (a resident per-unit vector: fc1's bias) in `like`'s form."""
        return v[mx.array(units)].astype(like.dtype)

    def index(self, v, idx: np.ndarray):
        """v[..., idx], v in this backend's form."""
        return v[..., mx.array(idx)]

    def zeros(self, x):
        """An FFN output of zeros for input x (no unit computed)."""
        return mx.zeros_like(x)

    def input_columns(self, w, rows, slots):
        """The dip layout's gate and up products [2, ..., n] from input-column rows: w @ gate[slots], w @ up[slots]."""
        return mx.stack([self.row_axpy(w, rows, slots, name) for name in ("gate", "up")])

    def activation(self, h):
        return ACTIVATIONS[self.ffn["activation"]](h)

    def glu(self, g, u):
        return glu(g, u, self.ffn["activation"])

    # -- the FFN over a set of rows ------------------------------------------------------------
    def units(
        self,
        x,
        rows,
        slots: np.ndarray,
        units: np.ndarray,
        resident: Dict[str, mx.array],
        mask: Optional[np.ndarray] = None,
        dst: Optional[np.ndarray] = None,
        n_out: int = 1,
    ):
        """The FFN of x [..., d] over the units `units` whose rows are rows[slots] (or a RowSet, slots None);
        `resident` holds the layer's resident tables (fc1's bias, the down codes' group scales). mask [rows of x,
        units] (0/1): the units each row uses (None: all). dst (non-decreasing, [len(units)]): [n_out, ..., d],
        partial sum i over the units with dst == i alone, each computed as if it were the only one."""
        if isinstance(rows, RowSet) and not self.in_place(x):
            rows, slots = rows.gather(), np.arange(len(rows))
        if dst is not None and not self.in_place(x):  # one product per partial sum: its own shape, its own order
            return per_partial(
                rows,
                slots,
                dst,
                n_out,
                lambda r, s, sel: self.units(x, r, s, units[sel], resident, None if mask is None else mask[:, sel]),
            )
        if self.ffn["kind"] == "glu":
            h = self.gate_up(x, rows, slots)
            return self.out(self._masked(h, mask), rows, slots, units, "down", resident, dst, n_out)
        h = self.row_dot(x, rows, slots, "fc1")
        if "fc1" in resident:
            h = h + self.take(resident["fc1"], units, h)
        return self.out(self._masked(self.activation(h), mask), rows, slots, units, "fc2", resident, dst, n_out)

    def bind_units(self, rows, slots, units, resident: Dict[str, mx.array], dst=None, n_out: int = 1):
        """x -> units(x, rows, slots, units, resident, None, dst, n_out), for a caller that computes the same units
        of the same rows each step (the slots array read at each call, as it is then)."""
        return lambda x: self.units(x, rows, slots, units, resident, None, dst, n_out)

    def gate_up(self, x, rows, slots):
        """A GLU's hidden units of x over rows[slots]: activation(x . gate) * (x . up)."""
        return self.glu(self.row_dot(x, rows, slots, "gate"), self.row_dot(x, rows, slots, "up"))

    def in_place(self, x) -> bool:
        """Whether products of input x read rows where they are (RowSet addresses) and take dst in one call."""
        return False

    def _masked(self, h, mask):
        return h if mask is None else h * mx.array(mask, dtype=h.dtype)

    def out(self, h, rows, slots, units, name: str, resident: Dict[str, mx.array], dst=None, n_out: int = 1):
        q = self.quant[name]
        if q is not None and q.get("resident_scales"):  # the source's codes; group scales resident
            return self.block_row_axpy(
                h, rows, slots, name, units, resident[f"{name}.scales"], resident.get(f"{name}.biases"), dst, n_out
            )  # None: symmetric
        return self.row_axpy(h, rows, slots, name, dst, n_out)

    # -- the two products (and the block-scaled one) ------------------------------------------
    def matrix(self, name: str) -> RowMatrix:
        return matrix(self.layout, name, self.quant.get(name))

    def row_dot(self, x, rows, slots, name: str):
        """out[..., j] = x . W_j, W_j the dequantised `name` row of rows[slots[j]] (x @ W[slots]^T)."""
        m, slots = self.matrix(name), mx.array(slots)
        w = gather(rows, slots, m.weight)
        if not m.bits:
            return x @ w.astype(x.dtype).T
        s, b = _scales_biases(rows, slots, m, x.dtype)
        return cpu_gemv.quantized_matmul(x, w, s, b, m.group_size, m.bits, transpose=True)

    def row_axpy(self, w, rows, slots, name: str, dst=None, n_out: int = 1):
        """out[..., :] = sum_j w[..., j] W_j (w @ W[slots]); dst: see `units` (in_place backends only)."""
        m, slots = self.matrix(name), mx.array(slots)
        wt = gather(rows, slots, m.weight)
        if not m.bits:
            return w @ wt.astype(w.dtype)
        s, b = _scales_biases(rows, slots, m, w.dtype)
        return cpu_gemv.quantized_matmul(w, wt, s, b, m.group_size, m.bits, transpose=False)

    def block_row_axpy(
        self, w, rows, slots, name: str, units, scales: mx.array, biases: Optional[mx.array], dst=None, n_out: int = 1
    ):
        """`row_axpy` for rows holding only the source's codes of `name` (convert --down-bits source): unit
        units[j] is in group units[j] // group_size, whose scales/biases [n_out] are rows of the resident
        tables (biases None: symmetric)."""
        q = self.quant[name]
        codes = gather(rows, mx.array(slots), self.layout.component(f"{name}.weight"))
        blocks = mx.array(np.asarray(units, dtype=np.int32) // int(q["group_size"]))
        return cpu_gemv.block_matmul(w, codes, blocks, scales, biases, int(q["bits"]))
