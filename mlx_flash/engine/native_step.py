"""A decode step of a llama-style flash model on the CPU, natively, layer by layer.

Through MLX's ops a decode step on the CPU costs ~15 op dispatches and a synchronisation per layer
before its FFN (on SmolLM2-135M, 30 layers: more time than its matvecs). Here the hidden state is one
float32 host row from the embedding to the head:

    x = embed(token)
    per layer:  _cpu_gemv.attention(x, h, ...)    x += attention(norm(x)) (KV written in place); h = norm2(x)
                x += engine.ffn_row(layer, h)      the FFN: the engine's selector, cache and CPU backend
    logits = head(norm(x))

Below the resident floor (resident.py) the streamed attention layers and LM head chunks are loaded by the
streamer in the same forward order, and bound for the kernels as they arrive.

Up to MAX_POSITIONS positions go through at once (a speculative verification pass, a short prompt): x is
[m, d], every matrix's rows are read once for all m, and each position's result is bit for bit what a step
of it alone gives. Longer prompts and everything else keep mlx-lm's forward: `HostKVCache` is an mlx-lm
KVCache whose keys and values live in host buffers both paths write. `HostDecoder.of(model)` says which
models it computes (llama attention, RoPE without scaling, quantised projections and head, MLX on the CPU)
and why not when it cannot.
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from ..compute import blocks, cpu_gemv
from .experts import FlashSwitchGLU
from .forward import Batchable, Forward
from .neurons import FlashFFN
from .resident import Absent, StreamedLayer, StreamedRows

ATTENTION = {"mlx_lm.models.llama": False, "mlx_lm.models.qwen3": True, "mlx_lm.models.qwen3_moe": True}  # -> q/k norms
# per native pass (prompt chunks, plan.prefill_step, are within what the budget lends them); longer: mlx-lm's forward
MAX_POSITIONS = 1024


class HostKVCache(Batchable, KVCache):
    """mlx-lm's KVCache (offset, trim, state, masks) with its keys and values in host buffers [1, n_kv, capacity,
    head_dim] of `dtype` (float16: half the memory, each key rounded once as it is stored), grown `step` positions
    at a time."""

    def __init__(self, step: int = 256, dtype=np.float32):
        self.step, self.offset, self.dtype = step, 0, np.dtype(dtype)
        self._k = self._v = None

    def reserve(self, n: int, heads: int, head_dim: int, v_dim: Optional[int] = None):
        """Room for n positions."""
        if self._k is not None and n <= self._k.shape[2]:
            return
        cap = -(-n // self.step) * self.step
        k = np.zeros((1, heads, cap, head_dim), self.dtype)
        v = np.zeros((1, heads, cap, v_dim or head_dim), self.dtype)
        if self._k is not None:
            k[:, :, : self.offset], v[:, :, : self.offset] = self._k[:, :, : self.offset], self._v[:, :, : self.offset]
        self._k, self._v = k, v

    def make_room(self, n: int):
        """Room for n positions shaped as the buffers held (a restored cache: engine/prompt_store.py)."""
        if self._k is not None:
            self.reserve(n, self._k.shape[1], self._k.shape[3], self._v.shape[3])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, L, D = keys.shape
        if B != 1:
            raise ValueError(f"HostKVCache holds one sequence, got a batch of {B}")
        self.reserve(self.offset + L, H, D, values.shape[3])
        self._k[:, :, self.offset : self.offset + L] = np.asarray(keys.astype(mx.float32))
        self._v[:, :, self.offset : self.offset + L] = np.asarray(values.astype(mx.float32))
        self.offset += L
        return (
            mx.array(self._k[:, :, : self.offset]).astype(keys.dtype),
            mx.array(self._v[:, :, : self.offset]).astype(values.dtype),
        )

    @property
    def keys(self):
        return None if self._k is None else mx.array(self._k[:, :, : self.offset])

    @property
    def values(self):
        return None if self._v is None else mx.array(self._v[:, :, : self.offset])

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v):
        keys, values, self.offset = v
        self.step = getattr(self, "step", 256)
        half = keys is not None and keys.dtype == mx.float16  # (a stored float16 cache stays float16)
        self.dtype = np.dtype(np.float16 if half else np.float32)
        self._k = None if keys is None else np.array(keys.astype(mx.float16 if half else mx.float32))
        self._v = None if values is None else np.array(values.astype(mx.float16 if half else mx.float32))

    def empty(self):
        return self._k is None

    @property
    def nbytes(self):
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes


def _quantised(layer) -> bool:
    """A quantised linear layer / embedding of a kind the kernels read (a streamed one: before its weights load)."""
    if blocks.is_blocks(layer):
        return "bias" not in layer
    return (
        isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and "bias" not in layer
        and getattr(layer, "mode", "affine") == "affine"
        and layer.bits in (2, 4, 8)
    )


def _handle(layer) -> Optional[tuple]:
    """(native handle, QuantRows) of a quantised linear layer / embedding's rows, None if the kernels cannot read it."""
    if not _quantised(layer):
        return None
    if blocks.is_blocks(layer):
        return blocks.handle(layer)
    w, s, b = layer["weight"], layer["scales"], layer.get("biases")  # b None: symmetric (format v4)
    n = w.shape[-1] * 32 // layer.bits
    if not (cpu_gemv.supports(layer.bits, layer.group_size, n, s.dtype) and cpu_gemv.contiguous(w, s, b)):
        return None
    q = cpu_gemv.QuantRows.of_matrix(w, s, b, layer.group_size, layer.bits)
    return cpu_gemv.linear(q, w.shape[0], isinstance(layer, cpu_gemv.InterleavedLinear)), q


def _rows_dot(x: np.ndarray, rows) -> np.ndarray:
    """x . each row of a handle's rows (`_handle`'s second): quantised rows, or GGML blocks."""
    if isinstance(rows, blocks.BlockRows):
        return rows.dot(x)
    return cpu_gemv.row_dot(x, rows, k=rows.w.shape[0])


def _interleaved(attention) -> list:
    """The handles of a resident attention's projections, each held as the native loops read it fastest
    (cpu_gemv.interleave, in place: the same bits, the same memory) where that applies."""
    for p in PROJECTIONS:
        if cpu_gemv.interleaves(getattr(attention, p)):
            cpu_gemv.interleave_layer(getattr(attention, p))
    return [_handle(getattr(attention, p))[0] for p in PROJECTIONS]


def _weight(norm) -> np.ndarray:
    return np.array(norm.weight.astype(mx.float32))


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _streamed_handles(module, names, rows=None, norms=()):
    """Handles on the quantised linears `names` of a streamed module (resident.StreamedLayer / StreamedRows), loaded
    now (rows: a head's chunk); '' names the module itself. The handles keep the loaded buffers alive. norms: names of
    RMSNorms inside it (Qwen3's q_norm, k_norm), whose weights follow the handles as float32 host copies."""
    with module.loaded(rows) as inner:
        handles = [_handle(getattr(inner, n) if n else inner) for n in names]
        weights = [_weight(getattr(inner, n)) for n in norms]
    if any(h is None for h in handles):
        raise RuntimeError(f"{type(inner).__name__}: streamed weights the native kernels cannot read")
    return handles + weights


class HostDecoder(Forward):
    """The native decode step of one loaded flash model (see the module's doc): the pass interface of forward.py."""

    name = "native"
    native = True

    def __init__(self, model, layers, head, head_streamed=None):
        self.model, self.layers, self.head, self.head_streamed = model, layers, head, head_streamed
        body = model.model
        for L, layer in zip(layers, body.layers):  # the resident attentions' handles (streamed ones: when loaded)
            if L["streamed"] is None:
                L["linears"] = _interleaved(layer.self_attn)
        mx.clear_cache()  # (the rows' arrays the interleaved ones replaced)
        last = not isinstance(body.norm, Absent)  # a pipeline stage before the last ends with hidden rows
        self.norm, self.eps = (_weight(body.norm), float(body.norm.eps)) if last else (None, None)
        # Whether each row of a pass computes as a pass of it alone whatever else the pass holds: the dense layers'
        # native kernels do; an MoE block's router and a long prompt's experts are MLX's ops, whose arithmetic
        # depends on the number of rows
        self.rows_alone = self.sequences_alone = all(isinstance(L["mlp"], FlashFFN) for L in layers)

    @classmethod
    def of(cls, model, engine):
        """(decoder, None) for a model the native step computes, else (None, why not)."""
        body = getattr(model, "model", None)
        if not cpu_gemv.available():
            return None, "the native CPU kernels are off or MLX computes on a GPU"
        if body is None or not hasattr(body, "layers") or not hasattr(body, "embed_tokens"):
            return None, "not a decoder-only layers/embed_tokens model"
        layers = []
        for i, layer in enumerate(body.layers):
            why = cls._unsupported(layer)
            if why:
                return None, f"layer {i}: {why}"
            streamed = layer.self_attn if isinstance(layer.self_attn, StreamedLayer) else None
            a = streamed.inner if streamed is not None else layer.self_attn
            # a streamed layer's are bound when loaded, checked by kind now; a resident one's bound below
            if streamed is not None and not all(_quantised(getattr(a, p)) for p in PROJECTIONS):
                return None, f"layer {i}: attention projections the native kernels cannot read"
            if streamed is None and any(_handle(getattr(a, p)) is None for p in PROJECTIONS):
                return None, f"layer {i}: attention projections the native kernels cannot read"
            rope = a.rope
            args = model.args  # (a streamed layer's weights are placeholders until loaded)
            head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
            inv_freq = (rope.base ** (-np.arange(0, rope.dims, 2, dtype=np.float32) / rope.dims)).astype(np.float32)
            layers.append(
                dict(
                    norm1=_weight(layer.input_layernorm),
                    norm2=_weight(layer.post_attention_layernorm),
                    eps=float(layer.input_layernorm.eps),
                    linears=None,
                    streamed=streamed,
                    qk_norms=([None, None] if streamed is not None else [_weight(a.q_norm), _weight(a.k_norm)])
                    + [float(a.q_norm.eps)]
                    if hasattr(a, "q_norm")
                    else [],
                    n_heads=a.n_heads,
                    n_kv=a.n_kv_heads,
                    head_dim=head_dim,
                    inv_freq=inv_freq,
                    traditional=bool(rope.traditional),
                    rope_scale=float(rope.scale),
                    scale=float(a.scale),
                    mlp=layer.mlp,
                )
            )
        if isinstance(body.norm, Absent):  # a pipeline stage before the last (models/stage.py): no norm, no head
            return cls(model, layers, None), None
        tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
        head_module = body.embed_tokens if tied else getattr(model, "lm_head", None)
        if isinstance(head_module, StreamedRows):
            head, head_streamed = None, head_module
            if not _quantised(head_module.inner):
                return None, "an LM head the native kernels cannot read"
        else:
            head, head_streamed = _handle(head_module), None
            if head is None:
                return None, "an LM head the native kernels cannot read"
        if type(body.norm) is not nn.RMSNorm:
            return None, "the final norm is not RMSNorm"
        return cls(model, layers, head and head[1], head_streamed), None

    @classmethod
    def unsupported(cls, model) -> Optional[str]:
        """Why the native step cannot compute `model` by its architecture (its modules' kinds, not their weights:
        a model mlx-lm built, weights lazy), or None."""
        body = getattr(model, "model", None)
        if body is None or not hasattr(body, "layers") or not hasattr(body, "embed_tokens"):
            return "not a decoder-only layers/embed_tokens model"
        for i, layer in enumerate(body.layers):
            why = cls._unsupported(layer, ffn=False)
            if why:
                return f"layer {i}: {why}"
        norm = getattr(body, "norm", None)
        return None if norm is None or type(norm) in (nn.RMSNorm, Absent) else "the final norm is not RMSNorm"

    @staticmethod
    def _unsupported(layer, ffn: bool = True) -> Optional[str]:
        a = getattr(layer, "self_attn", None)
        a = a.inner if isinstance(a, StreamedLayer) else a
        if a is None or type(a).__module__ not in ATTENTION:
            return "not llama or qwen3 attention"
        if type(a.rope) is not nn.RoPE:
            return f"RoPE {type(a.rope).__name__} (scaled)"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if ATTENTION[type(a).__module__]:
            norms += [a.q_norm, a.k_norm]
        if any(type(n) is not nn.RMSNorm for n in norms):
            return "norms other than RMSNorm"
        if ffn and not (
            isinstance(layer.mlp, FlashFFN) or isinstance(getattr(layer.mlp, "switch_mlp", None), FlashSwitchGLU)
        ):
            return "an FFN outside the flash engine"
        return None

    @staticmethod
    def _load_attention(L) -> list:
        """A streamed attention layer's q, k, v, o handles, then (Qwen3) its q/k norms' weights and their eps: loaded
        now, the norms with the projections since they are inside the streamed module."""
        names = ("q_norm", "k_norm") if L["qk_norms"] else ()
        got = _streamed_handles(L["streamed"], PROJECTIONS, norms=names)
        return [h[0] for h in got[:4]] + got[4:] + L["qk_norms"][2:]

    def applies(self, tokens, cache) -> bool:
        """Up to MAX_POSITIONS positions (one on the dip layout, whose selector takes one) and every layer's cache a
        HostKVCache (the FFN's engine is each layer's current one: the bench swaps engines)."""
        one = getattr(self.model.flash, "dip_layout", False)
        return (
            0 < len(tokens) <= (1 if one else MAX_POSITIONS)
            and cache is not None
            and all(type(c) is HostKVCache for c in cache)
        )

    def __call__(self, tokens, cache, prompt: bool = False) -> mx.array:
        """Logits [1, m, vocab] of `tokens` (m ints) at the caches' offset (a prompt: [1, 1, vocab] of the last one,
        and the stats count a prompt pass); the caches advance by m."""
        self.model.flash.stats.touch(prefill=prompt)  # (a streamed embedding would begin it as a prompt)
        return self.logits(self.run_layers(self.embed(tokens), cache, prompt), prompt)

    def embed(self, tokens) -> np.ndarray:
        """The float32 host rows [m, d] of `tokens`."""
        ids = np.asarray(tokens, dtype=np.int32).reshape(1, -1)
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if vocab and ids.size and not 0 <= ids.min() <= ids.max() < vocab:  # (the lookup would read past the table)
            raise ValueError(f"token ids must lie in [0, {vocab}): got {ids.min()}..{ids.max()}")
        table = self.model.model.embed_tokens
        if cpu_gemv.embeds(table):
            return cpu_gemv.embed(ids, table)
        return np.array(table(mx.array(ids)).astype(mx.float32)).reshape(ids.shape[1], -1)

    def run_layers(self, x: np.ndarray, cache, prompt: bool = False) -> np.ndarray:
        """The hidden rows x [m, d] (float32, updated in place) through every layer, the caches advanced by m (a
        pipeline stage: its layers, from the rows the stage before sent)."""
        return self._layers(x, [len(x)], [[c] for c in cache], prompt)

    def logits(self, x: np.ndarray, prompt: bool = False) -> mx.array:
        """The head's logits [1, m, vocab] of the last layer's rows x (a prompt: of its last row)."""
        logits = self._head(x[-1:] if prompt else x)
        return mx.array(logits).reshape(1, len(logits), -1)

    def stage(self, x, cache, prompt: bool = False):
        """forward.Forward.stage: token ids or rows through this stage's layers, to rows or (the last) logits."""
        if isinstance(x, list):
            self.model.flash.stats.touch(prefill=prompt)
            x = self.embed(x)
        x = self.run_layers(np.ascontiguousarray(x, dtype=np.float32), cache, prompt)
        return x if self.norm is None else self.logits(x, prompt)

    def run(self, seqs: List[Tuple[List[int], List[HostKVCache]]], prompt: bool = False) -> np.ndarray:
        """Logits [len(seqs), vocab] of each sequence's last token, every sequence (its token ids, its cache in each
        layer) at its own position in one pass: the units read once for all, each sequence's logits and keys what a
        pass of it alone gives. The caches advance by each sequence's tokens."""
        lengths = [len(ids) for ids, _ in seqs]
        self.model.flash.stats.touch(prefill=prompt)
        x = self.embed([t for ids, _ in seqs for t in ids])
        x = self._layers(x, lengths, [list(layer) for layer in zip(*(caches for _, caches in seqs))], prompt)
        return self._head(x[np.cumsum(lengths) - 1])

    def _layers(self, x: np.ndarray, lengths: List[int], caches: List[List[HostKVCache]], prompt: bool) -> np.ndarray:
        """Host rows x [m, d] (float32, updated in place: `lengths` rows of each sequence in turn) through every
        layer, each sequence at its own cache's offset; caches[layer][sequence] advance by its rows."""
        h = np.empty_like(x)
        for L, cs in zip(self.layers, caches):
            segments = []
            for c, m in zip(cs, lengths):
                c.reserve(c.offset + m, L["n_kv"], L["head_dim"])
                segments.append((c._k, c._v, c.offset, c._k.shape[2], m))
            q, k, v, o, *qk_norms = L["linears"] + L["qk_norms"] if L["linears"] else self._load_attention(L)
            cpu_gemv.attention_batch(
                x,
                h,
                L["norm1"],
                L["norm2"],
                L["eps"],
                q,
                k,
                v,
                o,
                segments,
                L["n_heads"],
                L["n_kv"],
                L["head_dim"],
                L["inv_freq"],
                L["traditional"],
                L["rope_scale"],
                L["scale"],
                *qk_norms,
            )
            for c, m in zip(cs, lengths):
                c.offset += m
            mlp = L["mlp"]
            if isinstance(mlp, FlashFFN):  # a dense FFN: the engine's selector, cache and kernels on the host rows
                x += mlp.ffn_row(h, prefill=prompt)
            else:
                with cpu_gemv.host_pass():
                    # a dense FFN's blocks (models/blocked.py), every one chosen: no router, no MLX op
                    y = mlp.blocks_sum(h) if hasattr(mlp, "blocks_sum") else None
                    if y is None:  # an MoE block in MLX ops, its products natively row by row (one sync: the router's)
                        y = np.array(mlp(mx.array(h)[None]).astype(mx.float32)).reshape(h.shape)
                    x += y
        return x

    def _head(self, x: np.ndarray) -> np.ndarray:
        """Logits [rows, vocab] of the final norm and LM head of host rows x."""
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.norm
        if self.head is not None:
            return _rows_dot(x, self.head)
        m = self.head_streamed  # streamed in chunks of vocabulary rows
        return np.concatenate([_rows_dot(x, _streamed_handles(m, [""], rows)[0][1]) for rows in m.chunks()], axis=-1)
