# OPT (Zhang et al., 2022) for mlx-lm, matching Hugging Face's OPTForCausalLM.
#
# mlx-lm ships no OPT, the ReLU model the "LLM in a flash" paper runs on. This
# module follows mlx-lm's model layout (ModelArgs / small modules / Model with
# `layers`, `sanitize`) so mlx-lm's `load_model`, `generate` and
# `stream_generate` work with it. The one departure from the HF layout is that
# each decoder layer's FFN lives in a submodule, `layers[i].mlp` (holding `fc1`
# and `fc2`), as mlx_flash requires; `sanitize` maps HF names onto it.

import re
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import (
    BaseModelArgs,
    create_attention_mask,
    scaled_dot_product_attention,
)

# HF's learned position embeddings are indexed from 2 (a fairseq leftover).
POSITION_OFFSET = 2

_ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_fast_approx,
    "silu": nn.silu,
    "swish": nn.silu,
    "tanh": mx.tanh,
    "sigmoid": mx.sigmoid,
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    ffn_dim: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    word_embed_proj_dim: Optional[int] = None
    activation_function: str = "relu"
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True
    _remove_final_layer_norm: bool = False

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            self.word_embed_proj_dim = self.hidden_size
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"Unsupported OPT activation_function {self.activation_function!r}; supported: {sorted(_ACTIVATIONS)}"
            )


def _layer_norm(args: ModelArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.hidden_size, eps=1e-5, affine=args.layer_norm_elementwise_affine)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        bias = args.enable_bias
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def __call__(
        self,
        x: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
    ) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)

        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)

        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.out_proj(output)


class MLP(nn.Module):
    """OPT's FFN: fc2(act(fc1(x))), act = ReLU for every released OPT."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.ffn_dim, bias=args.enable_bias)
        self.fc2 = nn.Linear(args.ffn_dim, args.hidden_size, bias=args.enable_bias)
        self.activation_function = args.activation_function

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(_ACTIVATIONS[self.activation_function](self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.do_layer_norm_before = args.do_layer_norm_before
        self.self_attn = Attention(args)
        self.self_attn_layer_norm = _layer_norm(args)
        self.mlp = MLP(args)
        self.final_layer_norm = _layer_norm(args)

    def __call__(
        self,
        x: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
    ) -> mx.array:
        pre = self.do_layer_norm_before
        r = self.self_attn(self.self_attn_layer_norm(x) if pre else x, mask, cache)
        h = x + r
        if not pre:
            h = self.self_attn_layer_norm(h)
        r = self.mlp(self.final_layer_norm(h) if pre else h)
        out = h + r
        if not pre:
            out = self.final_layer_norm(out)
        return out


def _positions(cache, L: int) -> mx.array:
    """Position ids (before the +2 offset) of the next L tokens.

    They continue from the KV cache's offset. A batched cache's offset is an
    array (per-row offset minus left padding); padded slots then get -1 as in
    HF, whose ids come from the attention mask's cumsum.
    """
    offset = 0 if cache is None else cache.offset
    steps = mx.arange(L)
    if isinstance(offset, mx.array) and offset.ndim > 0:
        pos = offset[:, None] + steps[None]
    else:
        pos = (steps + offset)[None]
    return mx.maximum(pos, -1)


class OPTDecoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.word_embed_proj_dim)
        self.embed_positions = nn.Embedding(args.max_position_embeddings + POSITION_OFFSET, args.hidden_size)
        if args.word_embed_proj_dim != args.hidden_size:
            self.project_in = nn.Linear(args.word_embed_proj_dim, args.hidden_size, bias=False)
            self.project_out = nn.Linear(args.hidden_size, args.word_embed_proj_dim, bias=False)
        else:
            self.project_in = None
            self.project_out = None
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        if args.do_layer_norm_before and not args._remove_final_layer_norm:
            self.final_layer_norm = _layer_norm(args)
        else:
            self.final_layer_norm = None

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: Optional[mx.array] = None,
    ) -> mx.array:
        if input_embeddings is not None:
            h = input_embeddings
        else:
            h = self.embed_tokens(inputs)
        if self.project_in is not None:
            h = self.project_in(h)

        if cache is None:
            cache = [None] * len(self.layers)

        positions = _positions(cache[0], h.shape[1])
        h = h + self.embed_positions(positions + POSITION_OFFSET).astype(h.dtype)

        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)

        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.decoder = OPTDecoder(args)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.decoder(inputs, cache, input_embeddings)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = OPTModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.word_embed_proj_dim, args.vocab_size, bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: Optional[mx.array] = None,
    ):
        out = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            out = self.model.decoder.embed_tokens.as_linear(out)
        else:
            out = self.lm_head(out)
        return out

    def sanitize(self, weights):
        """HF OPT names -> this module's names.

        - `decoder.*` (checkpoints saved from OPTModel) -> `model.decoder.*`
        - `...layers.N.fc1.*` / `fc2.*` -> `...layers.N.mlp.fc1.*` / `mlp.fc2.*`
        - `lm_head.weight` is dropped when the embeddings are tied.
        """
        out = {}
        for k, v in weights.items():
            if k.startswith("decoder."):
                k = "model." + k
            k = re.sub(r"(\.layers\.\d+\.)(fc[12]\.)", r"\1mlp.\2", k)
            out[k] = v
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    @property
    def layers(self):
        return self.model.decoder.layers
