"""A call's rows (`RowSet`: rows in several buffers) and the checks every backend applies to its arguments.

A per-layer cache is a uint8 mx.array `rows` [capacity, stride]; where a matrix lives in a row is
format.layout.RowMatrix.
"""

import contextvars
from contextlib import contextmanager
from typing import List, Optional

import mlx.core as mx
import numpy as np

from . import cpu_gemv

FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def check_rows(rows) -> None:
    if rows.ndim != 2 or rows.dtype != mx.uint8:
        raise ValueError(f"rows must be uint8 [capacity, stride], got {rows.dtype} {rows.shape}")


def check_float(a, what: str) -> None:
    if a.dtype not in FLOATS and a.dtype != np.float32:
        raise TypeError(f"{what} must be float16, bfloat16 or float32, got {a.dtype}")


def slots_array(slots) -> np.ndarray:
    """Slots as int32 numpy [k] (from a list, numpy or mx array)."""
    s = np.asarray(slots, dtype=np.int32)
    if s.ndim != 1:
        raise ValueError(f"slots must be 1-D, got shape {s.shape}")
    return s


def per_partial(rows, slots, dst: np.ndarray, n: int, f):
    """f(rows, slots, sel) once per partial sum i (sel: the positions with dst == i; a RowSet's own rows when slots
    is None), stacked [n, ...]: each partial computed alone, in its own shape and order."""
    outs = []
    for i in range(n):
        sel = np.flatnonzero(dst == i)
        outs.append(f(rows.take(sel), None, sel) if slots is None else f(rows, slots[sel], sel))
    return np.stack(outs) if isinstance(outs[0], np.ndarray) else mx.stack(outs)


class RowSet:
    """The rows of one call's units when they live in several buffers (cache rows, rows read ahead, the scratch
    buffer): row j is parts[which[j]][slots[j]], in the call's unit order. Native kernels read them in place by
    address; MLX ops gather them into one array."""

    def __init__(self, parts, which: np.ndarray, slots: np.ndarray):
        self.parts, self.which, self.slots = parts, np.asarray(which), np.asarray(slots, dtype=np.int64)
        self._addresses = None

    def __len__(self):
        return len(self.slots)

    def single(self):
        """(rows, slots) when every row is in one part, else (self, None): what fn takes."""
        first = self.which[0]
        if (self.which == first).all():
            return self.parts[first], self.slots
        return self, None

    def take(self, sel: np.ndarray) -> "RowSet":
        return RowSet(self.parts, self.which[sel], self.slots[sel])

    def addresses(self) -> np.ndarray:
        """int64 [k]: where each row starts in memory (every part evaluated, C-contiguous, held by the caller)."""
        if self._addresses is not None:
            return self._addresses
        bases, strides = np.zeros(len(self.parts), dtype=np.int64), np.zeros(len(self.parts), dtype=np.int64)
        for i in np.flatnonzero(np.bincount(self.which, minlength=len(self.parts))):
            v = np.asarray(memoryview(self.parts[i]))
            if not v.flags.c_contiguous:
                raise ValueError("RowSet: every part must be C-contiguous rows")
            bases[i], strides[i] = v.ctypes.data, v.shape[1]
        self._addresses = bases[self.which] + self.slots * strides[self.which]
        return self._addresses

    def gather(self) -> mx.array:
        """The rows as one uint8 array [k, stride] (the narrowest part's stride), in order: a take per run of rows
        in the same part."""
        width = min(p.shape[1] for p in self.parts)
        cuts = np.flatnonzero(np.diff(self.which)) + 1
        runs = zip(np.r_[0, cuts], np.r_[cuts, len(self.which)])
        return mx.concatenate(
            [self.parts[self.which[a]][mx.array(self.slots[a:b].astype(np.int32)), :width] for a, b in runs], axis=0
        )


# -- rows of several sequences in one pass ----------------------------------------------------------------------

_SEGMENTS = contextvars.ContextVar("segments", default=None)
SPLIT_ALWAYS = False  # tests: products per sequence as on a GPU, on the CPU (each sequence's bits must not move)


@contextmanager
def segmented(lengths: Optional[List[int]]):
    """A pass whose rows are several sequences', `lengths` rows each in turn (engine.forward); None: one sequence's
    rows (inside a mixer run per sequence)."""
    token = _SEGMENTS.set(None if lengths is None else list(lengths))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def segments() -> Optional[List[int]]:
    """The rows of each sequence of the pass in progress, None outside a pass of several."""
    return _SEGMENTS.get()


def independent(quantized: bool) -> bool:
    """Whether a product's rows compute as each would alone, whatever other rows it holds: MLX's quantised matmuls
    on the CPU do (tests/test_forward.py holds them to it); a float matmul on the CPU (BLAS picks its kernel by the
    rows), any matmul on a GPU (a matrix-vector kernel for one row, tiles for more) and the native kernels' quantised
    products (cpu_gemv.quantized_matmul: many rows as float matmuls of dequantised weights) need not."""
    return quantized and not SPLIT_ALWAYS and mx.default_device() == mx.cpu and not cpu_gemv.available()


def per_segment(x: mx.array, lengths: List[int], f) -> mx.array:
    """f of each sequence's rows of x [..., d] (the rows of its leading axes, in order) alone, laid end to end. Rows
    one a sequence (the head on each one's last position) are taken so."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] != sum(lengths):
        if flat.shape[0] != len(lengths):
            raise ValueError(f"{flat.shape[0]} rows for sequences of {lengths} rows")
        lengths = [1] * len(lengths)
    cuts = np.cumsum(lengths)[:-1].tolist()
    outs = [f(part) for part in mx.split(flat, cuts, axis=0)]
    return mx.concatenate(outs, axis=0).reshape(*x.shape[:-1], outs[0].shape[-1])
