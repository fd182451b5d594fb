"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5 MoE) as llama.cpp's converter stores them, back in mlx-lm's layout.

What convert_hf_to_gguf.py does to them (Qwen3NextModel and _LinearAttentionVReorderBase), undone here:
  * qwen3next: in_proj_qkvz, whose rows are grouped per key head ([q, k, v, z] of each head), is split into attn_qkv
    (every head's q, then k, then v) and attn_gate (z): joined again and regrouped as mlx-lm's in_proj_qkvz, written
    under the GGUF's legacy name for it, ssm_in;
  * qwen35moe: where there are more value heads than key heads, the value heads are reordered from grouped by key
    head to tiled (v0 of every key head, then v1, ...) in attn_qkv's v rows, attn_gate, ssm_alpha / ssm_beta, ssm_a,
    ssm_dt, conv1d's v channels and ssm_out's columns: put back in grouped order;
  * both: A_log is stored as -exp(A_log) (ssm_a, taken back with log(-a)), the conv1d kernel squeezed to
    [channels, kernel] (mlx-lm's Conv1d takes [channels, kernel, 1]); RMSNorm weights are stored + 1 as mlx-lm's
    sanitize makes them, so they are kept.
Every change is a permutation of whole rows (exact on quantised rows too), of whole quantisation groups of columns, or
a float transform of a 1-D float tensor.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import SourceError, UnsupportedArchitectureError
from .gguf_config import Meta

Tensor = Tuple[str, str, Dict[str, object], Optional[Tuple[int, int]]]  # (as gguf.Tensor)


def _rows(arrays: dict, perm: np.ndarray) -> dict:
    import mlx.core as mx

    idx = mx.array(perm)
    return {k: mx.take(v, idx, axis=0) for k, v in arrays.items()}


def _untile(n_k: int, per_k: int, dim: int) -> np.ndarray:
    """The index permutation taking value heads stored tiled ([v_i of each key head] for i in 0..per_k) to grouped
    order ([v_0..v_per_k of key head 0], ...), each head `dim` wide: grouped = tiled[perm]."""
    return np.arange(n_k * per_k * dim).reshape(per_k, n_k, dim).transpose(1, 0, 2).reshape(-1)


def _dequantized(arrays: dict, quant) -> "object":
    import mlx.core as mx

    if quant is None:
        return next(iter(arrays.values())).astype(mx.float32)
    s, b = (arrays[k].astype(mx.float32) for k in ("scales", "biases"))
    return mx.dequantize(arrays["weight"], s, b, group_size=quant[0], bits=quant[1])


class DeltaNetRearranger:
    """Takes the GGUF's tensors in order and hands back what mlx-lm's layout needs (see the module docstring)."""

    def __init__(self, meta: Meta, tiled: bool):
        a = meta["general.architecture"]
        self.path = meta.path
        self.n_k, self.n_v = meta.int(f"{a}.ssm.group_count"), meta.int(f"{a}.ssm.time_step_rank")
        self.d_k = meta.int(f"{a}.ssm.state_size")
        if self.n_k < 1 or self.n_v % self.n_k:
            raise SourceError(f"{meta.path}: {self.n_v} value heads cannot be grouped over {self.n_k} key heads")
        self.d_v = meta.int(f"{a}.ssm.inner_size") // self.n_v
        self.joined = not tiled  # qwen3next's in_proj_qkvz, split in two
        self.tiled = tiled and self.n_v != self.n_k  # (one value head per key head: both orders are the same)
        self.held: Dict[str, Dict[str, Tensor]] = {}  # per block: qwen3next's attn_qkv / attn_gate, until both came

    def __call__(self, base: str, part: str, arrays: dict, quant) -> List[Tensor]:
        stem, _, kind = base.rpartition(".")
        per_k, key_dim = self.n_v // self.n_k, self.n_k * self.d_k
        if kind == "ssm_a":  # -exp(A_log)
            import mlx.core as mx

            a = arrays["weight"].astype(mx.float32)
            if mx.any(a >= 0).item():
                raise SourceError(f"{self.path}: {base} has values >= 0, not -exp(A_log)")
            arrays = {"weight": mx.log(-a)}
        if kind == "ssm_conv1d":
            arrays = {k: v.reshape(*v.shape, 1) for k, v in arrays.items()}
        if self.tiled:
            arrays = self._grouped(kind, arrays, quant, per_k, key_dim)
        elif self.joined and kind in ("attn_qkv", "attn_gate"):
            self.held.setdefault(stem, {})[kind] = (base, part, arrays, quant)
            if len(self.held[stem]) < 2:
                return []
            return [(f"{stem}.ssm_in", part, *self._qkvz(self.held.pop(stem), per_k, key_dim))]
        return [(base, part, arrays, quant)]

    def _grouped(self, kind: str, arrays: dict, quant, per_k: int, key_dim: int) -> dict:
        if kind in ("attn_qkv", "ssm_conv1d"):  # the v rows after q and k
            v = _untile(self.n_k, per_k, self.d_v) + 2 * key_dim
            return _rows(arrays, np.concatenate([np.arange(2 * key_dim), v]))
        if kind == "attn_gate":
            return _rows(arrays, _untile(self.n_k, per_k, self.d_v))
        if kind in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            return _rows(arrays, _untile(self.n_k, per_k, 1))
        if kind == "ssm_out":
            return self._columns(arrays, quant, _untile(self.n_k, per_k, 1), self.d_v)
        return arrays

    def _columns(self, arrays: dict, quant, heads: np.ndarray, width: int) -> dict:
        """Columns permuted by heads of `width` (grouped = tiled[:, perm]): quantised, whole groups move."""
        import mlx.core as mx

        if quant is None:
            cols = (heads[:, None] * width + np.arange(width)).reshape(-1)
            return {k: mx.take(v, mx.array(cols), axis=1) for k, v in arrays.items()}
        if width % quant[0]:
            raise UnsupportedArchitectureError(
                f"{self.path}: value heads {width} wide split {quant[0]}-value quantisation groups (ssm_out)"
            )
        out = {}
        for k, v in arrays.items():  # weight: [rows, groups * words]; scales / biases: [rows, groups]
            g = width // quant[0]
            per = v.shape[1] // (len(heads) * g)
            blocks = v.reshape(v.shape[0], len(heads), g * per)
            out[k] = mx.take(blocks, mx.array(heads), axis=1).reshape(v.shape)
        return out

    def _qkvz(self, held: dict, per_k: int, key_dim: int):
        """attn_qkv and attn_gate joined, rows regrouped per key head as in_proj_qkvz ([q, k, v, z] of each)."""
        import mlx.core as mx

        (_, _, qkv, q1), (_, _, gate, q2) = held["attn_qkv"], held["attn_gate"]
        if q1 == q2 and qkv.keys() == gate.keys():
            arrays, quant = {k: mx.concatenate([qkv[k], gate[k]]) for k in qkv}, q1
        else:  # quantised differently (e.g. Q4_0 beside a K-quant): exact as float32
            arrays, quant = {"weight": mx.concatenate([_dequantized(qkv, q1), _dequantized(gate, q2)])}, None
        v = per_k * self.d_v
        idx = np.arange(2 * key_dim + 2 * self.n_k * v)
        parts = np.split(idx, [key_dim, 2 * key_dim, 2 * key_dim + self.n_k * v])
        heads = [p.reshape(self.n_k, -1) for p in parts]
        return _rows(arrays, np.concatenate(heads, axis=1).reshape(-1)), quant

    def finish(self) -> None:
        if self.held:
            alone = [base for block in self.held.values() for base, *_ in block.values()]
            raise SourceError(f"{self.path}: {', '.join(alone)} without its attn_qkv / attn_gate other half")
