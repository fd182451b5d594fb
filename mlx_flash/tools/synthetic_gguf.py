"""Synthetic GGUF files: a preset's exact shapes (synthetic.PRESETS: llama, qwen3_moe; or any other of MOE_TYPES by
model_type=, see tiny_moe), random Q4_0 weights (or --type: K-quants as llama-quantize mixes them), the tensor names
and metadata of llama.cpp's converter.

    python -m mlx_flash.tools.synthetic_gguf --preset llama-7b --out FILE

So llama.cpp, mlx-lm and mlx_flash can run the same weights of a model we have no real weights
for: this file goes to llama.cpp as it is, through `mlx_flash.convert` to mlx_flash, and through
`mlx_flash.convert.export` to mlx-lm. Speed does not depend on the values; only the shapes and bytes matter.

Every 2-D weight (and 3-D stacked experts) is Q4_0 (32 values per 18-byte block: a float16 scale, 16 bytes
of nibbles), with random nibbles and a scale giving each row's outputs about unit variance; norms are float32
ones, MoE routers float32. MoE presets draw nibbles from 1..15 (zero-mean values: see `_q4_0`). The tokenizer
is byte-level BPE ("gpt2", pre-tokenizer "default"): the 256 byte symbols, one merge, <|endoftext|> (BOS/EOS) and
filler tokens up to the vocabulary size.
`routing` (MoE presets: own, uniform, skewed) is synthetic.py's: the blocks' output projections scaled down and
the token embeddings of unit variance (uniform, skewed), a shared embedding direction and biased routers (skewed);
llama.cpp routes as mlx_flash does, since both run this file.
Tensors are generated and written one at a time (memory: one tensor, at most the 7B's embedding,
74 MB), into a temporary name renamed when complete.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from ..format.ggml import BLOCKS as BLOCKS_OF  # (values, bytes) of a block of each type
from ..format.ggml import random_rows
from ..models.tiny import bytes_to_unicode
from .synthetic import PRESETS, ROUTINGS, output_scale, preset_config, shared_direction, skewed_embedding, skewed_router

# model_type -> llama.cpp's architecture name (Mixtral is "llama" with experts)
GGUF_ARCHS = {
    "llama": "llama",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "olmoe": "olmoe",
    "gpt_oss": "gpt-oss",
    "deepseek_v3": "deepseek2",
    "glm4_moe": "glm4moe",
    "dots1": "dots1",
    "minimax": "minimax-m2",
    "granitemoe": "granitemoe",
    "ernie4_5_moe": "ernie4_5-moe",
    "llama4": "llama4",
    "qwen3_next": "qwen3next",
    "qwen3_5_moe": "qwen35moe",
    "hunyuan_moe": "hunyuan-moe",
    "deepseek_v32": "deepseek32",
}
DEEPSEEK = ("deepseek_v3", "deepseek_v32")  # MLA as llama.cpp's deepseek2 stores it (deepseek32: and the indexer)
MOE_TYPES = tuple(t for t in GGUF_ARCHS if t != "llama")
# how these architectures' blocks differ from qwen3moe's, as llama.cpp's converter writes them: q/k/v biases, q/k
# norms per head or over all heads (None: none), the FFN's norm, leading dense layers, the router's correction bias
# (exp_probs_b), shared experts (*_shexp) and a multi-token-prediction block (GLM's nextn) after the model's own
BLOCKS = {
    "glm4_moe": dict(
        qkv_bias=True, qk_norm="head", ffn_norm="post_attention_norm", dense=True, probs_b=True, shexp=True, nextn=True
    ),
    "dots1": dict(qk_norm="head", dense=True, probs_b=True, shexp=True),
    "minimax": dict(qk_norm="all", probs_b=True),
    "granitemoe": dict(),
    "ernie4_5_moe": dict(dense=True, shexp=True),  # (an ERNIE without moe_statics: no exp_probs_b)
    "llama4": dict(interleave=True, shexp=True),  # (dense layers between the MoE ones, as Maverick's)
    "hunyuan_moe": dict(qk_norm="head", shexp=True),  # (its q/k norms after RoPE, its shared MLP ungated)
}
# kept float32: routers, DeepSeek's per-head MLA matrices, gated DeltaNet's conv1d kernels
FLOAT_TENSORS = ("ffn_gate_inp", "attn_k_b", "attn_v_b", "ssm_conv1d")
# gated DeltaNet hybrids (Qwen3-Next; Qwen3.5 MoE, its value heads stored tiled): llama.cpp's tensor names for the
# key/value heads' projections
DELTANET = {"qwen3_next": ("ssm_ba",), "qwen3_5_moe": ("ssm_beta", "ssm_alpha")}
Q4_0_BLOCK = 32
Q4_0_BYTES = 18  # float16 scale + 16 bytes of nibbles


def tiny_moe(model_type: str) -> dict:
    """write_gguf overrides of "moe-small" for a tiny MoE GGUF of `model_type` (2 layers of 8 experts of 64,
    d_model 256) as llama.cpp's converter writes that architecture: the tests' and benchmarks/moe_gguf_check.py's."""
    c = dict(
        model_type=model_type,
        num_hidden_layers=2,
        vocab_size=512,
        num_experts=8,
        hidden_size=256,
        moe_intermediate_size=64,
        num_attention_heads=4,
        head_dim=64,
        num_key_value_heads=2,
    )
    if model_type == "qwen2_moe":
        c.update(shared_expert_intermediate_size=128)
    if model_type in ("olmoe", "dots1"):
        c.update(num_key_value_heads=4)  # llama.cpp's OLMoE and dots1: no GQA
    if model_type == "deepseek_v32":  # DeepSeek-V3.2's lightning indexer: 24 of the keys for each query
        c.update(index_n_heads=8, index_head_dim=64, index_topk=24)  # (llama.cpp rotates 64-wide keys)
    if model_type in DEEPSEEK:  # MLA, a dense first layer, a shared expert, 2 groups of 4 experts, YaRN
        c.update(
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=128,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=1,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    if model_type in BLOCKS:  # a dense first layer and a shared expert where the model has them
        c.update(num_hidden_layers=3, intermediate_size=128, first_k_dense_replace=1)
        c.update(n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
        if BLOCKS[model_type].get("probs_b"):  # 4 of 8 experts, chosen by the correction bias (see write_gguf)
            c.update(num_experts_per_tok=4)
    if model_type == "glm4_moe":  # GLM-4.5's half-rotary heads and its MTP block
        c.update(partial_rotary_factor=0.5, num_nextn_predict_layers=1)
    if model_type == "llama4":  # top-1 routing; MoE and dense layers alternating, the fourth without RoPE
        c.update(num_experts_per_tok=1, num_hidden_layers=4, interleave_moe_layer_step=2, rope_theta=500000.0)
    if model_type in DELTANET or model_type == "hunyuan_moe":  # 2 of the 8 experts: the top-k renormalised matters
        c.update(num_experts_per_tok=2)
    if model_type in DELTANET:  # a DeltaNet layer, then a full-attention one; 2 value heads per key head
        c.update(
            full_attention_interval=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            shared_expert_intermediate_size=64,
            intermediate_size=128,
            partial_rotary_factor=0.25,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
        )
    if model_type == "hunyuan_moe":  # llama.cpp's experts are feed_forward_length wide; the head is the embedding
        c.update(intermediate_size=c["moe_intermediate_size"], tie_word_embeddings=True)
    if model_type == "minimax":  # a rotary part of each head
        c.update(rotary_dim=32)
    if model_type == "granitemoe":  # Granite's multipliers; the head is the embedding
        c.update(attention_multiplier=0.0625, embedding_multiplier=6.0, residual_multiplier=0.5, logits_scaling=4.0)
        c.update(tie_word_embeddings=True, rope_theta=10000.0)
    if model_type == "gpt_oss":  # sliding layers shorter than a test's prompt; gpt-oss's YaRN
        c.update(
            sliding_window=16,
            rope_theta=150000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        )
    return c


def _q4_0(rng, rows: int, cols: int, zero_mean: bool = False, scale: float = 1.0) -> np.ndarray:
    """Random Q4_0 rows as raw bytes [rows, cols / 32 * 18]: values d * (q - 8), q uniform in 0..15, or in 1..15
    (`zero_mean`: 0..15 has mean -0.5, a direction shared by every row, which sends every token of an MoE model
    to the same few experts); outputs of about `scale` times unit variance."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    if zero_mean:
        lo, hi = rng.integers(1, 16, size=(2, rows, cols // Q4_0_BLOCK, Q4_0_BYTES - 2), dtype=np.uint8)
        blocks[..., 2:] = lo | (hi << 4)
    d = np.float16(scale / (np.sqrt(cols) * (4.32 if zero_mean else 4.6)))  # the std of q - 8
    blocks[..., :2] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def _mxfp4(rng, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """Random MXFP4 rows as raw bytes [rows, cols / 32 * 17] (gpt-oss's experts): an e8m0 scale byte giving each
    row's outputs about `scale` times unit variance (e2m1 codes drawn uniformly: rms 2.93), then 16 bytes of codes."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, 17), dtype=np.uint8)
    blocks[..., 0] = 127 + round(np.log2(scale / (2.93 * np.sqrt(cols))))
    return blocks.reshape(rows, -1)


def tokenizer_tokens(vocab_size: int):
    """(tokens, token types, merges, eos id) of the byte-level tokenizer padded to `vocab_size`."""
    from gguf import TokenType

    byte_map = bytes_to_unicode()
    tokens = [byte_map[b] for b in range(256)] + ["Ġt", "<|endoftext|>"]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokens)} tokens")
    types = [TokenType.NORMAL] * 257 + [TokenType.CONTROL]
    tokens += [f"<|filler{i}|>" for i in range(vocab_size - len(tokens))]
    types += [TokenType.UNUSED] * (vocab_size - len(types))
    return tokens, types, ["Ġ t"], 257


def _tensors(c: dict):
    """(GGUF name, shape) of every tensor in llama.cpp's order. write_gguf stores 1-D shapes (norms), biases and
    FLOAT_TENSORS (routers) as float32, gpt-oss's experts as MXFP4, the rest as Q4_0 (3-D: stacked experts)."""
    d, v = c["hidden_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    moe, oss = c["model_type"] in MOE_TYPES, c["model_type"] == "gpt_oss"
    if c["model_type"] in DEEPSEEK:
        yield from _deepseek2_tensors(c)
        return
    if c["model_type"] in BLOCKS:
        yield from _blocks_tensors(c, BLOCKS[c["model_type"]])
        return
    if c["model_type"] in DELTANET:
        yield from _deltanet_tensors(c)
        return
    yield "token_embd.weight", (v, d)
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,)
        yield b + "attn_q.weight", (q, d)
        yield b + "attn_k.weight", (kv, d)
        yield b + "attn_v.weight", (kv, d)
        yield b + "attn_output.weight", (d, q)
        if c["model_type"] in ("qwen2_moe", "gpt_oss"):  # q/k/v biases (and gpt-oss's o bias and sinks)
            yield from ((b + f"attn_{x}.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv)))
        if oss:
            yield b + "attn_output.bias", (d,)
            yield b + "attn_sinks.weight", (c["num_attention_heads"],)
        if c["model_type"] in ("qwen3_moe", "olmoe"):  # per head in Qwen3, over all heads in OLMoE
            yield b + "attn_q_norm.weight", (hd if c["model_type"] == "qwen3_moe" else q,)
            yield b + "attn_k_norm.weight", (hd if c["model_type"] == "qwen3_moe" else kv,)
        yield b + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), (d,)
        if moe:
            e, ff = c["num_experts"], c["moe_intermediate_size"]
            yield b + "ffn_gate_inp.weight", (e, d)
            yield b + "ffn_gate_exps.weight", (e, ff, d)
            yield b + "ffn_up_exps.weight", (e, ff, d)
            yield b + "ffn_down_exps.weight", (e, d, ff)
            if oss:  # the router's and the experts' biases
                yield from (
                    (b + f"ffn_{x}.bias", n)
                    for x, n in (
                        ("gate_inp", (e,)),
                        ("gate_exps", (e, ff)),
                        ("up_exps", (e, ff)),
                        ("down_exps", (e, d)),
                    )
                )
            if c["model_type"] == "qwen2_moe":  # the shared expert and its gate (a float row)
                sh = c["shared_expert_intermediate_size"]
                yield b + "ffn_gate_inp_shexp.weight", (d,)
                yield b + "ffn_gate_shexp.weight", (sh, d)
                yield b + "ffn_up_shexp.weight", (sh, d)
                yield b + "ffn_down_shexp.weight", (d, sh)
        else:
            ff = c["intermediate_size"]
            yield b + "ffn_gate.weight", (ff, d)
            yield b + "ffn_up.weight", (ff, d)
            yield b + "ffn_down.weight", (d, ff)
    yield "output_norm.weight", (d,)
    if not c.get("tie_word_embeddings"):
        yield "output.weight", (v, d)


def _blocks_tensors(c: dict, t: dict):
    """The tensors of an architecture of BLOCKS: attention, then dense or MoE FFNs, in llama.cpp's names."""
    d, v, h = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    hd = c.get("head_dim") or d // h
    q, kv = h * hd, c["num_key_value_heads"] * hd
    e, ff = c["num_experts"], c["moe_intermediate_size"]
    yield "token_embd.weight", (v, d)
    n = c["num_hidden_layers"]
    for i in range(n + (c.get("num_nextn_predict_layers", 0) if t.get("nextn") else 0)):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,)
        yield from ((b + f"attn_{x}.weight", (m, d)) for x, m in (("q", q), ("k", kv), ("v", kv)))
        if t.get("qkv_bias"):
            yield from ((b + f"attn_{x}.bias", (m,)) for x, m in (("q", q), ("k", kv), ("v", kv)))
        yield b + "attn_output.weight", (d, q)
        if t.get("qk_norm"):
            yield b + "attn_q_norm.weight", (hd if t["qk_norm"] == "head" else q,)
            yield b + "attn_k_norm.weight", (hd if t["qk_norm"] == "head" else kv,)
        yield b + t.get("ffn_norm", "ffn_norm") + ".weight", (d,)
        if (t.get("dense") and i < c["first_k_dense_replace"]) or (
            t.get("interleave") and (i + 1) % c["interleave_moe_layer_step"]
        ):
            m = c["intermediate_size"]
            yield from ((b + "ffn_gate.weight", (m, d)), (b + "ffn_up.weight", (m, d)), (b + "ffn_down.weight", (d, m)))
            continue
        yield b + "ffn_gate_inp.weight", (e, d)
        if t.get("probs_b"):
            yield b + "exp_probs_b.bias", (e,)
        yield from ((b + "ffn_gate_exps.weight", (e, ff, d)), (b + "ffn_up_exps.weight", (e, ff, d)))
        yield b + "ffn_down_exps.weight", (e, d, ff)
        if t.get("shexp"):
            sh = c["n_shared_experts"] * ff
            yield from ((b + "ffn_gate_shexp.weight", (sh, d)), (b + "ffn_up_shexp.weight", (sh, d)))
            yield b + "ffn_down_shexp.weight", (d, sh)
        if i >= n:  # the MTP block's own: the embedding and hidden state, normed, joined and projected
            yield from ((b + "nextn.eh_proj.weight", (d, 2 * d)), (b + "nextn.enorm.weight", (d,)))
            yield from ((b + "nextn.hnorm.weight", (d,)), (b + "nextn.shared_head_norm.weight", (d,)))
    yield "output_norm.weight", (d,)
    if not c.get("tie_word_embeddings"):
        yield "output.weight", (v, d)


def _deltanet_tensors(c: dict):
    """Qwen3-Next's / Qwen3.5 MoE's tensors as llama.cpp's converter writes them: in the DeltaNet layers q, k, v
    (attn_qkv) apart from the output gate z (attn_gate), -exp(A_log) (ssm_a), the squeezed conv1d kernel; in the
    full-attention ones the query doubled by its gate; experts and a shared expert in every layer."""
    d, v, h, hd = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"]
    kv, e, ff, sh = (
        c["num_key_value_heads"] * hd,
        c["num_experts"],
        c["moe_intermediate_size"],
        c["shared_expert_intermediate_size"],
    )
    n_k, n_v = c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim, value_dim = n_k * c["linear_key_head_dim"], n_v * c["linear_value_head_dim"]
    yield "token_embd.weight", (v, d)
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,)
        if (i + 1) % c["full_attention_interval"]:
            yield from ((b + "attn_qkv.weight", (2 * key_dim + value_dim, d)), (b + "attn_gate.weight", (value_dim, d)))
            ba = DELTANET[c["model_type"]]
            yield from ((b + f"{x}.weight", (2 * n_v // len(ba), d)) for x in ba)
            yield from ((b + "ssm_conv1d.weight", (2 * key_dim + value_dim, c["linear_conv_kernel_dim"])),)
            yield from (
                (b + "ssm_dt.bias", (n_v,)),
                (b + "ssm_a", (n_v,)),
                (b + "ssm_norm.weight", (c["linear_value_head_dim"],)),
            )
            yield b + "ssm_out.weight", (d, value_dim)
        else:
            yield from (
                (b + "attn_q.weight", (2 * h * hd, d)),
                (b + "attn_k.weight", (kv, d)),
                (b + "attn_v.weight", (kv, d)),
            )
            yield from (
                (b + "attn_output.weight", (d, h * hd)),
                (b + "attn_q_norm.weight", (hd,)),
                (b + "attn_k_norm.weight", (hd,)),
            )
        yield b + "post_attention_norm.weight", (d,)
        yield from ((b + "ffn_gate_inp.weight", (e, d)), (b + "ffn_gate_exps.weight", (e, ff, d)))
        yield from ((b + "ffn_up_exps.weight", (e, ff, d)), (b + "ffn_down_exps.weight", (e, d, ff)))
        yield from ((b + "ffn_gate_inp_shexp.weight", (d,)), (b + "ffn_gate_shexp.weight", (sh, d)))
        yield from ((b + "ffn_up_shexp.weight", (sh, d)), (b + "ffn_down_shexp.weight", (d, sh)))
    yield "output_norm.weight", (d,)
    yield "output.weight", (v, d)


def _deltanet_meta(w, c: dict) -> None:
    w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_full_attention_interval(c["full_attention_interval"])
    if c["model_type"] == "qwen3_5_moe":  # (its multimodal RoPE sections, which text positions leave plain)
        rope = int(c["head_dim"] * c["partial_rotary_factor"]) // 2
        w.add_rope_dimension_sections([rope - 2 * (rope // 3), rope // 3, rope // 3, 0])


def _blocks_meta(w, c: dict) -> None:
    """The metadata llama.cpp's converter writes for an architecture of BLOCKS, beyond write_gguf's common keys."""
    import gguf

    t = c["model_type"]
    if t == "granitemoe":  # Granite's multipliers (feed_forward_length is the experts')
        w.add_attention_scale(c["attention_multiplier"])
        w.add_embedding_scale(c["embedding_multiplier"])
        w.add_residual_scale(c["residual_multiplier"])
        w.add_logit_scale(c["logits_scaling"])
        return
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if t == "hunyuan_moe":  # (softmax routing renormalised: fixed in llama.cpp's; the NTK alpha in the RoPE base)
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_shared_feed_forward_length(c["n_shared_experts"] * c["moe_intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        return
    if t == "llama4":  # (feed_forward_length is the dense layers')
        w.add_interleave_moe_layer_step(c["interleave_moe_layer_step"])
        return
    if t != "minimax":  # a dense first layer and a shared expert
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_expert_shared_count(c["n_shared_experts"])
    if t == "ernie4_5_moe":  # (softmax routing: fixed in llama.cpp's ERNIE)
        w.add_interleave_moe_layer_step(1)
        # its converter's intermediate_size // num_key_value_heads, which llama.cpp reads as the shared expert's width
        w.add_expert_shared_feed_forward_length(c["intermediate_size"] // c["num_key_value_heads"])
        return
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # (GLM and dots.llm1 route so, whatever they say)
    if t == "minimax":
        return
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    if t == "glm4_moe":
        w.add_expert_group_count(1)
        w.add_expert_group_used_count(1)
        w.add_nextn_predict_layers(c["num_nextn_predict_layers"])


def _deepseek2_tensors(c: dict):
    """llama.cpp's deepseek2 tensors: MLA as its converter writes it (kv_b split per head into k_b, transposed, and
    v_b), dense leading layers, then routed experts with a correction bias and shared experts."""
    d, v, h = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    rope, nope, vd, ql, kl = (
        c[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank")
    )
    e, ff, sh = c["num_experts"], c["moe_intermediate_size"], c["n_shared_experts"] * c["moe_intermediate_size"]
    yield "token_embd.weight", (v, d)
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        yield from (
            (b + "attn_norm.weight", (d,)),
            (b + "attn_q_a_norm.weight", (ql,)),
            (b + "attn_kv_a_norm.weight", (kl,)),
            (b + "attn_q_a.weight", (ql, d)),
            (b + "attn_q_b.weight", (h * (nope + rope), ql)),
            (b + "attn_kv_a_mqa.weight", (kl + rope, d)),
            (b + "attn_k_b.weight", (h, kl, nope)),
            (b + "attn_v_b.weight", (h, vd, kl)),
            (b + "attn_output.weight", (d, h * vd)),
            (b + "ffn_norm.weight", (d,)),
        )
        if "index_topk" in c:  # the lightning indexer: a LayerNorm on its one key head, a weight per query head
            n, m = c["index_n_heads"], c["index_head_dim"]
            yield from ((b + "indexer.k_norm.weight", (m,)), (b + "indexer.k_norm.bias", (m,)))
            yield from ((b + "indexer.proj.weight", (n, d)), (b + "indexer.attn_k.weight", (m, d)))
            yield b + "indexer.attn_q_b.weight", (n * m, ql)
        if i < c["first_k_dense_replace"]:
            n = c["intermediate_size"]
            yield from ((b + "ffn_gate.weight", (n, d)), (b + "ffn_up.weight", (n, d)), (b + "ffn_down.weight", (d, n)))
        else:
            yield from (
                (b + "ffn_gate_inp.weight", (e, d)),
                (b + "exp_probs_b.bias", (e,)),
                (b + "ffn_gate_exps.weight", (e, ff, d)),
                (b + "ffn_up_exps.weight", (e, ff, d)),
                (b + "ffn_down_exps.weight", (e, d, ff)),
                (b + "ffn_gate_shexp.weight", (sh, d)),
                (b + "ffn_up_shexp.weight", (sh, d)),
                (b + "ffn_down_shexp.weight", (d, sh)),
            )
    yield "output_norm.weight", (d,)
    yield "output.weight", (v, d)


def _deepseek2_meta(w, c: dict) -> None:
    import gguf

    kl, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(kl)
    w.add_key_length(kl + rope)  # (the absorbed form: MQA over the latent)
    w.add_value_length(kl)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    w.add_rope_scaling_yarn_log_mul(0.1 * c["rope_scaling"]["mscale_all_dim"])
    if "index_topk" in c:
        w.add_indexer_head_count(c["index_n_heads"])
        w.add_indexer_key_length(c["index_head_dim"])
        w.add_indexer_top_k(c["index_topk"])


BLOCK_OUTPUTS = ("attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_down.weight")


def _q4_0_from(make, rows: int, cols: int, chunk: int = 8192) -> np.ndarray:
    """`rows` float rows from make(n) as Q4_0 bytes [rows, cols / 32 * 18], made a chunk at a time."""
    from gguf import GGMLQuantizationType, quants

    out = np.empty((rows, cols // Q4_0_BLOCK * Q4_0_BYTES), np.uint8)
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        out[i : i + n] = quants.quantize(make(n), GGMLQuantizationType.Q4_0)
    return out


# --type: what llama.cpp's llama-quantize writes for each (file type, its name in gguf.LlamaFileType)
TYPES = {"Q4_0": "MOSTLY_Q4_0", "Q4_K_M": "MOSTLY_Q4_K_M", "Q4_K": "MOSTLY_Q4_K_S", "Q6_K": "MOSTLY_Q6_K",
         "Q8_0": "MOSTLY_Q8_0", "Q2_K": "MOSTLY_Q2_K", "Q3_K_M": "MOSTLY_Q3_K_M",
         "IQ4_XS": "MOSTLY_IQ4_XS"}  # fmt: skip
# the type of most tensors in a mix (llama-quantize's default_type)
MIXES = {"Q4_K_M": "Q4_K", "Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "IQ4_XS": "IQ4_XS"}
# llama.cpp's fallbacks for rows that are not whole K-quant blocks (its Q5_0 for Q4_K and Q5_1 for Q5_K: Q4_0 and
# Q8_0 stand in here)
FALLBACK = {"Q4_K": "Q4_0", "Q5_K": "Q8_0", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _mixed(name: str, ftype: str, layers: int, gqa: int, experts: int) -> str:
    """llama-quantize's llama_tensor_get_type for the mixes (MIXES) on the tensors synthetic files hold: the output
    in Q6_K, and more bits for attn_k, attn_v, attn_output and ffn_down by file type, layer, grouped queries and
    experts."""
    kind = MIXES[ftype]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight":
        return "Q6_K"
    if "attn_k." in name and experts == 8:
        return "Q8_0"
    if "attn_v." in name:
        if experts == 8:
            return "Q8_0"
        if ftype == "Q2_K":
            return "Q4_K" if gqa >= 4 else "Q3_K"
        if ftype == "Q3_K_M":
            return "Q5_K" if layer < 2 else "Q4_K"
        if ftype == "IQ4_XS" and gqa >= 4:
            return "Q5_K"
        return "Q6_K" if ftype == "Q4_K_M" and _more_bits(layer, layers) else kind
    if "ffn_down" in name:
        if ftype == "Q2_K":
            return "Q3_K"
        if ftype == "Q3_K_M":
            return "Q5_K" if layer < layers // 16 else "Q4_K"
        if ftype == "IQ4_XS" and layer < layers // 8:  # (without an importance matrix)
            return "Q5_K"
        return "Q6_K" if ftype == "Q4_K_M" and _more_bits(layer, layers) else kind
    if "attn_output" in name:
        if experts == 8:
            return "Q5_K"
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(ftype, kind)
    return kind


def tensor_type(name: str, shape: tuple, ftype: str, layers: int, gqa: int = 1, experts: int = 0) -> str:
    """The block type of 2-D (and stacked 3-D) weight `name` in a file of type `ftype` (TYPES), as llama-quantize
    chooses it (a mix's types by _mixed; FALLBACK where a row is not whole blocks), in a model of `layers` layers,
    `gqa` query heads a key head and `experts` experts."""
    kind = _mixed(name, ftype, layers, gqa, experts) if ftype in MIXES else ftype
    if shape[-1] % BLOCKS_OF[kind][0]:
        kind = FALLBACK.get(kind, kind)
    return kind


def write_gguf(
    preset: str, out, seed: int = 0, progress: bool = True, routing: str = "own", gguf_type: str = "Q4_0", **overrides
) -> Path:
    """Write preset `preset` (with config `overrides`, e.g. vocab_size=512, or tiny_moe(model_type)) as a GGUF file
    of random weights in blocks of `gguf_type` (TYPES; gpt-oss's experts: MXFP4), with MoE `routing` (own, uniform,
    skewed)."""
    import gguf

    if gguf_type not in TYPES:
        raise ValueError(f"gguf_type {gguf_type!r}: one of {', '.join(TYPES)}")

    c = preset_config(preset)
    c.update(overrides)
    if c["model_type"] not in GGUF_ARCHS:
        raise ValueError(f"{preset}: only {', '.join(GGUF_ARCHS)} presets can be written as GGUF")
    quiet = output_scale(routing)
    if routing != "own" and c["model_type"] not in MOE_TYPES:
        raise ValueError("a routing choice is for MoE presets")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    arch = GGUF_ARCHS[c["model_type"]]
    moe = c["model_type"] in MOE_TYPES
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"synthetic {preset}" + ("" if routing == "own" else f", {routing} routing"))
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    nextn = c.get("num_nextn_predict_layers", 0) if BLOCKS.get(c["model_type"], {}).get("nextn") else 0
    w.add_block_count(c["num_hidden_layers"] + nextn)
    # as llama.cpp writes them: feed_forward_length is the experts'
    experts_only = c["model_type"] in ("mixtral", "olmoe", "gpt_oss", "minimax", "granitemoe", "hunyuan_moe")
    w.add_feed_forward_length(c["moe_intermediate_size"] if experts_only else c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1 if c["model_type"] in DEEPSEEK else c["num_key_value_heads"])  # (MLA: MQA over the latent)
    if c["model_type"] in DEEPSEEK:
        _deepseek2_meta(w, c)
    else:
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(c.get("rotary_dim") or int(hd * c.get("partial_rotary_factor", 1.0)))
    if c["model_type"] in BLOCKS:
        _blocks_meta(w, c)
    if c["model_type"] in DELTANET:
        _deltanet_meta(w, c)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(getattr(gguf.LlamaFileType, TYPES[gguf_type]))
    if moe:
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        if c["model_type"] not in ("mixtral", "olmoe", *BLOCKS):  # (mixtral's, olmoe's: feed_forward_length only)
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c["model_type"] == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        if c["model_type"] == "gpt_oss":
            w.add_sliding_window(c["sliding_window"])
    if c.get("rope_scaling"):  # YaRN, as gpt-oss's and DeepSeek-V3's configs have it
        r = c["rope_scaling"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r["factor"])
        w.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(r["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(r["beta_slow"])
    tokens, types, merges, eos = tokenizer_tokens(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)

    specs = list(_tensors(c))
    oss = c["model_type"] == "gpt_oss"
    layers, experts = c["num_hidden_layers"], c.get("num_experts", 0)
    gqa = c["num_attention_heads"] // (c.get("num_key_value_heads") or c["num_attention_heads"])
    skewed = "Q4_0" if routing == "skewed" else None  # (a skewed embedding is quantised from floats: Q4_0's quantiser)
    kinds = {
        name: (name == "token_embd.weight" and skewed) or tensor_type(name, shape, gguf_type, layers, gqa, experts)
        for name, shape in specs
    }
    for name, shape in specs:
        if len(shape) == 1 or any(f in name for f in FLOAT_TENSORS) or name.endswith(".bias"):
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        elif oss and "_exps." in name:  # gpt-oss's experts: MXFP4
            raw = (*shape[:-1], shape[-1] // Q4_0_BLOCK * 17)
            w.add_tensor_info(
                name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=gguf.GGMLQuantizationType.MXFP4
            )
        else:
            kind = kinds[name]
            raw = (*shape[:-1], shape[-1] // BLOCKS_OF[kind][0] * BLOCKS_OF[kind][1])
            w.add_tensor_info(
                name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=getattr(gguf.GGMLQuantizationType, kind)
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    u = shared_direction(rng, c["hidden_size"]) if routing == "skewed" else None
    from tqdm import tqdm

    moe_k = c.get("num_experts_per_tok", 0)
    for name, shape in tqdm(specs, desc=f"gguf {preset}", unit="tensor", disable=not progress):
        scale = quiet if name.endswith(BLOCK_OUTPUTS) else 1.0
        if name.endswith("ssm_a"):  # -exp(A_log), A_log of HF's initialisation (log of uniform 0..16)
            data = -rng.uniform(0.5, 16.0, shape).astype(np.float32)
        elif "exp_probs_b" in name and moe_k < shape[0]:
            # the router's correction bias 0, 1, ..., E - 1 shuffled: wider than the sigmoid scores' range, it alone
            # picks the experts, so a wrong mapping picks others, and llama.cpp's int8 activations (its CPU's
            # Q4_0 products) cannot flip a near tie
            data = rng.permutation(shape[0]).astype(np.float32)
        elif name.endswith(".bias") or "ffn_gate_inp_shexp" in name or "attn_sinks" in name:
            data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(c["hidden_size"])).astype(np.float32)
        elif len(shape) == 1:
            data = np.ones(shape, np.float32)
        elif u is not None and name.endswith("ffn_gate_inp.weight"):  # a skewed router
            data = skewed_router(rng, *shape, u)
        elif any(f in name for f in FLOAT_TENSORS):  # the router: float, as llama.cpp's converter keeps it
            data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        elif u is not None and name == "token_embd.weight":
            data = _q4_0_from(lambda n: skewed_embedding(rng, n, shape[1], u), *shape)
        elif oss and "_exps." in name:
            data = _mxfp4(rng, int(np.prod(shape[:-1])), shape[-1], scale).reshape(*shape[:-1], -1)
        else:
            if name == "token_embd.weight" and routing != "own":
                scale = np.sqrt(shape[-1])  # entries of unit variance: the blocks' outputs are small beside them
            rows = int(np.prod(shape[:-1]))
            if kinds[name] == "Q4_0":  # (the draws of files written before other types: the same files)
                data = _q4_0(rng, rows, shape[-1], zero_mean=moe, scale=scale)
            else:
                data = random_rows(rng, kinds[name], rows, shape[-1], scale=scale, zero_mean=moe)
            data = data.reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="Write a synthetic GGUF file (a preset's shapes, random Q4_0 weights).")
    p.add_argument("--preset", required=True, choices=[k for k, v in PRESETS.items() if v["model_type"] in GGUF_ARCHS])
    p.add_argument("--out", required=True, help="Output .gguf file.")
    p.add_argument("--routing", default="own", choices=ROUTINGS, help="MoE presets: own (sticky), uniform, skewed.")
    p.add_argument("--type", default="Q4_0", choices=TYPES, help="The file's block types, as llama-quantize's.")
    a = p.parse_args(argv)
    path = write_gguf(a.preset, a.out, routing=a.routing, gguf_type=a.type)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
