"""Resident matrices kept as their GGUF stores them: rows of GGML blocks (format/ggml.py), never re-quantised.

A K-quant or i-quant file's attention projections, LM head and token embedding (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K,
IQ4_*) have no exact MLX quantisation of the same size; convert keeps their bytes as they are (uint8
[rows, row bytes]) and these modules compute with them:

  * natively on the CPU (`cpu_gemv.block_dot`, llama.cpp's integer block sums: the arithmetic of the experts read in
    place) for up to NATIVE_ROWS float32 rows, and in the native decode step (`handle`);
  * on a GPU, a few rows (decode steps) by the Metal kernel of kernels/ggml_blocks.metal, which reads the blocks as
    they are;
  * in MLX's ops otherwise (prompts; the tested reference): Q4_0 / Q8_0 / Q4_K as MLX affine codes
    (`ggml.to_affine`, MLX's quantised product), the others dequantised (`ggml.dequantize`) into a float product. A
    matrix's temporaries then take TEMPORARY_BYTES a value; a matrix of more (an LM head) is computed in chunks of
    rows, each evaluated before the next is made, so that no more than CHUNK_BYTES of temporaries are alive.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..format import ggml
from ..io import kernel_source
from . import cpu_gemv

CHUNK_BYTES = 64 << 20  # MLX's temporaries of one product of a large matrix (an LM head) at a time
KERNEL_FILE = "ggml_blocks.metal"


def _build_kernel():
    path = kernel_source.kernel_path(KERNEL_FILE)
    if path is None:
        return None, None
    src = kernel_source.split_sections(path.read_text())
    kernel = mx.fast.metal_kernel(
        name="ggml_block_dot",
        input_names=["x", "w"],
        output_names=["out"],
        source=src["block_dot"],
        header=src["header"],
    )
    return kernel, src


# Built once at import (building needs no Metal; only calling does).
_kernel, KERNEL_SOURCES = _build_kernel()


def _metal_applies(x: mx.array) -> bool:
    """The Metal kernel computes a few rows (decode steps, verification passes) where MLX runs on a GPU."""
    rows = x.size // max(1, x.shape[-1])
    return _kernel is not None and 0 < rows <= cpu_gemv.NATIVE_ROWS and mx.metal.is_available()


def _metal_product(x: mx.array, w: mx.array, kind: str) -> mx.array:
    """x @ W^T by the kernel of kernels/ggml_blocks.metal: W's blocks read as they are."""
    k, n = w.shape[0], x.shape[-1]
    xs = x.reshape(-1, n)
    values, nbytes = ggml.BLOCKS[kind]
    template = [("KIND", cpu_gemv.GGML_KINDS[kind]), ("N", n), ("RB", w.shape[-1]), ("VALUES", values)]
    (out,) = _kernel(
        inputs=[xs, w],
        template=[*template, ("BB", nbytes), ("TO", x.dtype)],
        grid=(32 * k, xs.shape[0], 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(xs.shape[0], k)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*x.shape[:-1], k)


def values_per_row(weight: mx.array, kind: str) -> int:
    values, nbytes = ggml.BLOCKS[kind]
    return weight.shape[-1] // nbytes * values


def _dot(x: np.ndarray, w, kind: str) -> np.ndarray:
    """float32 [..., k]: x . each row of w (k rows of `kind` blocks), natively."""
    return cpu_gemv.block_dot(x, w, (0,), w.shape[-1], kind, x.shape[-1], k=w.shape[0])[..., 0]


def _rows_applies(x: mx.array) -> bool:
    return x.dtype == mx.float32 and cpu_gemv.native_rows(x.size // max(1, x.shape[-1])) and cpu_gemv.available()


def _mlx_product(x: mx.array, w: mx.array, kind: str) -> mx.array:
    """x @ W^T in MLX's ops for rows w of `kind` blocks."""
    if kind in ggml.AFFINE:
        codes, scales, biases, bits = ggml.to_affine(w, kind)
        return mx.quantized_matmul(x, codes, scales, biases, transpose=True, group_size=32, bits=bits)
    return x @ ggml.dequantize(w, kind).astype(x.dtype).T


def matmul(x: mx.array, weight: mx.array, kind: str) -> mx.array:
    """x [..., n] @ W^T for W's rows of GGML `kind` blocks, uint8 [k, row bytes]: natively for a few float32 rows on
    the CPU, else in MLX's ops, in chunks of rows where their temporaries would exceed CHUNK_BYTES."""
    if _rows_applies(x) and cpu_gemv.contiguous(weight):
        y = _dot(np.asarray(x).reshape(-1, x.shape[-1]), weight, kind)
        return mx.array(y).reshape(*x.shape[:-1], weight.shape[0])
    if _metal_applies(x):
        return _metal_product(x, weight, kind)
    rows = weight.shape[0]
    per = max(1, rows * CHUNK_BYTES // max(1, ggml.temporary_bytes(kind, weight.nbytes)))
    if per >= rows:
        return _mlx_product(x, weight, kind)
    parts = []
    for i in range(0, rows, per):
        parts.append(_mlx_product(x, weight[i : i + per], kind))
        mx.eval(parts[-1])  # one chunk's temporaries alive at a time
    return mx.concatenate(parts, axis=-1)


class BlockLinear(nn.Linear):
    """nn.Linear whose weight is rows of GGML blocks (uint8 [out, row bytes]) of `kind`."""

    def __call__(self, x):
        y = matmul(x, self["weight"], self.kind)
        return y + self["bias"] if "bias" in self else y


class BlockEmbedding(nn.Embedding):
    """nn.Embedding whose table is rows of GGML blocks: a lookup dequantises the rows it reads; as_linear (a tied LM
    head) is `matmul`."""

    def __call__(self, x):
        return ggml.dequantize(self["weight"][x], self.kind)

    def as_linear(self, x):
        return matmul(x, self["weight"], self.kind)


def keep_blocks(module: nn.Module, kind: str) -> nn.Module:
    """Make `module` (an nn.Linear or nn.Embedding) hold its weight as rows of `kind` blocks, in place: a weight not
    loaded yet becomes an empty uint8 one of their shape (load_weights then checks theirs against it); one loaded
    as blocks stays. Returns it."""
    if type(module) not in (nn.Linear, nn.Embedding):
        raise TypeError(f"{type(module).__name__}: only linear layers and embeddings are kept as GGML blocks")
    if kind not in ggml.BLOCKS:
        raise ValueError(f"{kind!r} is not a GGML block type ({', '.join(ggml.BLOCKS)})")
    rows, n = module["weight"].shape
    if module["weight"].dtype != mx.uint8:
        module.weight = mx.zeros((rows, ggml.row_bytes(kind, n)), dtype=mx.uint8)
    module.__class__ = BlockLinear if type(module) is nn.Linear else BlockEmbedding
    module.kind = kind
    return module


def is_blocks(module: nn.Module) -> bool:
    return isinstance(module, (BlockLinear, BlockEmbedding))


def block_kinds(model: nn.Module) -> dict:
    """{module path: GGML type} of the model's modules holding GGML blocks."""
    return {p: m.kind for p, m in model.named_modules() if is_blocks(m)}


class BlockRows:
    """A block module's rows for the native decode step: `dot` computes x's logits / projections."""

    def __init__(self, module: nn.Module):
        self.w, self.kind = module["weight"], module.kind
        self.k, self.n = self.w.shape[0], values_per_row(self.w, self.kind)

    def dot(self, x: np.ndarray) -> np.ndarray:
        return _dot(x, self.w, self.kind)


def handle(module: nn.Module) -> Optional[tuple]:
    """(native `linear` handle, BlockRows) of a block module, for the native decode step's attention and head."""
    rows = BlockRows(module)
    if not cpu_gemv.contiguous(rows.w):
        return None
    return cpu_gemv.block_linear(rows.w, rows.k, rows.n, rows.kind), rows
