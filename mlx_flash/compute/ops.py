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
from . import rows as row_rules
from .ffn import ACTIVATIONS, glu
from .rows import RowSet, per_partial

_WORDS = (mx.uint32, mx.uint16, mx.uint8)


def _row_runs(lengths):
    """(first row, end, a prompt's) of a pass's rows: each sequence's rows of more than one position apart (a prompt
    chunk), the decode rows (one position each) together."""
    out, at = [], 0
    for m in lengths:
        if m == 1 and out and not out[-1][2] and out[-1][1] == at:
            out[-1] = (out[-1][0], at + 1, False)
        else:
            out.append((at, at + m, m > 1))
        at += m
    return out


def _runs(sizes: np.ndarray):
    """(size, count) of each run of equal consecutive sizes."""
    cuts = np.flatnonzero(np.diff(sizes)) + 1
    return [(int(sizes[a]), int(b - a)) for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(sizes)])]


def gather(rows: mx.array, slots: Optional[mx.array], c: Component) -> mx.array:
    """Component `c` of rows[slots] (None: every row, in order) as [k, *c.shape] of its dtype.

    The gather reads the cache viewed as the widest word that divides the component's
    offset and size (and the stride): MLX's take copies element by element, so uint32
    words are ~3x faster than bytes; the result is viewed as the component's dtype.
    """
    stride = rows.shape[1]
    if slots is None and c.offset % DTYPES[c.dtype].size:  # (in place, as its file has it: copied out aligned)
        slots = mx.arange(rows.shape[0])
    word = next(w for w in _WORDS if c.offset % w.size == 0 and c.nbytes % w.size == 0 and stride % w.size == 0)
    table = rows if word == mx.uint8 else mx.view(rows, word)
    lo = c.offset // word.size
    sub = table[:, lo : lo + c.nbytes // word.size]
    sub = sub if slots is None else mx.take(sub, slots, axis=0)
    dtype = DTYPES[c.dtype]
    if dtype != word:
        sub = mx.view(sub, dtype)
    return sub.reshape(sub.shape[0], *c.shape)


def _scales_biases(rows, slots, m: RowMatrix):
    """A quantised matrix's scales and biases as stored (MLX's quantised products take them so; symmetric: derived)."""
    s = gather(rows, slots, m.scales)
    b = symmetric_biases(s, m.bits) if m.symmetric else gather(rows, slots, m.biases)
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
        """Compute y (an array, or a list of them) now, before the rows it reads are overwritten."""
        mx.eval([a for a in (y if isinstance(y, list) else [y]) if isinstance(a, mx.array)])

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
        lengths = row_rules.segments()
        if (
            lengths
            and len(lengths) > 1
            and not self.in_place(x)
            and not row_rules.independent(all(self.quant.values()))
        ):
            f = lambda part, m: self.units(part, rows, slots, units, resident, m, dst, n_out)  # noqa: E731
            return self._per_sequence(x, lengths, mask, f)
        if dst is not None and mask is None and self._blocked(x):
            out = self._glu_blocks(x, rows, slots, units, resident, dst, n_out)
            if out is not None:
                return out
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

    @staticmethod
    def _per_sequence(x, lengths, mask, f):
        """f(rows, their mask) of each sequence's rows of x [..., d] alone (a pass of it alone: products whose rows
        round by the rows beside them), laid end to end as `units` gives them."""
        flat = x.reshape(-1, x.shape[-1])
        bounds = np.cumsum([0, *lengths]).tolist()
        with row_rules.segmented(None):
            outs = [f(flat[a:b], None if mask is None else mask[a:b]) for a, b in zip(bounds, bounds[1:])]
        out = mx.concatenate(outs, axis=-2)
        return out.reshape(*out.shape[:-2], *x.shape[:-1], out.shape[-1])

    def _blocked(self, x) -> bool:
        """Whether `_glu_blocks` computes these units: MLX ops on a GLU whose rows hold quantised gate, up and down
        (down's codes with their own scales, or the source's with group scales resident)."""
        if self.in_place(x) or self.ffn["kind"] != "glu":
            return False
        return all(self.quant.get(name) for name in ("gate", "up", "down"))

    def _glu_blocks(self, x, rows, slots, units, resident, dst, n_out: int):
        """`units` with partial sums (dst): [n_out, ..., d]. Gate and up are one product each over every unit, down
        one batched product over the blocks (mx.gather_qmm, a block a batch element), so a call's operations do not
        grow with its blocks; a block's partial sum is the same whichever call computes it, and a row's whatever
        other rows x holds (compute.rows.independent: MLX's quantised matmuls on the CPU)."""
        q = self.quant["down"]
        if q.get("resident_scales"):  # (whole groups of units, as a dense layer's blocks are)
            gs = int(q["group_size"])
            if len(units) % gs or not np.array_equal(units.reshape(-1, gs), units[::gs, None] + np.arange(gs)):
                return None
        slots = np.asarray(slots, dtype=np.int32)
        whole = len(slots) == rows.shape[0] and np.array_equal(slots, np.arange(len(slots)))
        sl = None if whole else mx.array(slots)  # (every row of the buffer in order: no gather)
        lengths = row_rules.segments() or [x.size // x.shape[-1]]  # (split by `units` where rows must be apart)
        return self._glu_rows(x, rows, sl, units, resident, dst, n_out, lengths)

    def _glu_rows(self, x, rows, sl, units, resident, dst, n_out: int, lengths) -> mx.array:
        """`_glu_blocks` of rows x of sequences of `lengths` rows each."""
        q = self.quant["down"]
        h = self.gate_up(x, rows, sl)
        lead, k = h.shape[:-1], h.shape[-1]
        h = h.reshape(-1, k)
        sizes = np.bincount(np.asarray(dst), minlength=n_out)
        outs = []
        for a, b, prompt in _row_runs(lengths):
            if prompt and q.get("resident_scales"):
                # a prompt's rows: the source's codes dequantised a block at a time, each computed before the next
                # (cpu_gemv.block_matmul: a block's memory, not a product per group of the prompt's rows)
                codes = gather(rows, sl, self.layout.component("down.weight"))
                at, blocks = np.r_[0, np.cumsum(sizes)], []
                for i in range(n_out):
                    blocks.append(self.block_rows(h[a:b], codes, units, resident, at[i], at[i + 1]))
                    mx.eval(blocks[-1])
                outs.append(mx.stack(blocks))
                continue
            parts, at = [], 0
            for size, n in _runs(sizes):  # consecutive blocks of one size: one batched product
                end = at + size * n
                hb = h[a:b, at:end].reshape(b - a, n, size).transpose(1, 0, 2)
                run = (rows[at:end], None) if sl is None else (rows, sl[at:end])
                parts.append(self._down_blocks(hb, *run, units[at:end], resident))
                at += size * n
            outs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        return out.reshape(n_out, *lead, out.shape[-1])

    def block_rows(self, h, codes, units, resident, lo: int, hi: int) -> mx.array:
        """h[:, lo:hi] @ the block of units lo:hi whose down rows are the source's codes (group scales resident)."""
        q = self.quant["down"]
        blocks = mx.array(np.asarray(units[lo:hi], dtype=np.int32) // int(q["group_size"]))
        return cpu_gemv.block_matmul(
            h[:, lo:hi], codes[lo:hi], blocks, resident["down.scales"], resident.get("down.biases"), int(q["bits"])
        )

    def _down_blocks(self, hb, rows, slots: mx.array, units: np.ndarray, resident) -> mx.array:
        """Partial sums [blocks, M, d] of hb [blocks, M, size] @ each block's down rows."""
        blocks, _, size = hb.shape
        q = self.quant["down"]
        bits, gs = int(q["bits"]), int(q.get("group_size") or 0)
        if not q.get("resident_scales"):  # each unit's down row quantised along d with its own scales
            m = self.matrix("down")
            w = gather(rows, slots, m.weight).reshape(blocks, size, -1)
            s, b = (a.reshape(blocks, size, -1) for a in _scales_biases(rows, slots, m))
            return mx.gather_qmm(hb, w, s, b, rhs_indices=mx.arange(blocks), transpose=False, group_size=gs, bits=bits)
        # the source's codes, each group of gs units sharing an output's scale and bias (resident tables):
        # sum_g S_g * (h_g @ codes_g) + B_g * sum(h_g), the codes' products a quantised matmul of unit scales
        codes = gather(rows, slots, self.layout.component("down.weight"))
        groups, m, d = blocks * size // gs, hb.shape[1], codes.shape[-1] * 32 // bits
        hg = hb.reshape(blocks, m, size // gs, gs).transpose(0, 2, 1, 3).reshape(groups, m, gs)
        one, zero, step = self._unit_scales(len(units), d, hb.dtype)
        z = mx.gather_qmm(
            hg,
            codes.reshape(groups, gs, -1),
            one.reshape(groups, gs, -1),
            zero.reshape(groups, gs, -1),
            rhs_indices=mx.arange(groups),
            transpose=False,
            group_size=step,
            bits=bits,
        )
        ids = mx.array(units[::gs] // gs)
        scale = resident["down.scales"][ids].astype(hb.dtype)[:, None]
        biases = resident.get("down.biases")
        bias = scale * -(1 << (bits - 1)) if biases is None else biases[ids].astype(hb.dtype)[:, None]
        part = scale * z + bias * hg.sum(axis=-1, keepdims=True)
        return part.reshape(blocks, size // gs, m, d).sum(axis=1)

    def _unit_scales(self, k: int, d: int, dtype):
        """Scales of one and biases of zero for k rows of d codes (a quantised matmul of the codes themselves), and
        their group size: one array each, kept for the largest k asked (the first k rows of it are the same)."""
        held = getattr(self, "_ones", None)
        if held is None or held[0].shape[0] < k or held[0].dtype != dtype or held[2] * held[0].shape[1] != d:
            step = next(g for g in (128, 64, 32) if d % g == 0)
            held = self._ones = (mx.ones((k, d // step), dtype), mx.zeros((k, d // step), dtype), step)
            mx.eval(held[:2])
        return held[0][:k], held[1][:k], held[2]

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
        m, slots = self.matrix(name), None if slots is None else mx.array(slots)
        w = gather(rows, slots, m.weight)
        if not m.bits:
            return x @ w.astype(x.dtype).T
        s, b = _scales_biases(rows, slots, m)
        return cpu_gemv.quantized_matmul(x, w, s, b, m.group_size, m.bits, transpose=True)

    def row_axpy(self, w, rows, slots, name: str, dst=None, n_out: int = 1):
        """out[..., :] = sum_j w[..., j] W_j (w @ W[slots]); dst: see `units` (in_place backends only)."""
        m, slots = self.matrix(name), mx.array(slots)
        wt = gather(rows, slots, m.weight)
        if not m.bits:
            return w @ wt.astype(w.dtype)
        s, b = _scales_biases(rows, slots, m)
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
