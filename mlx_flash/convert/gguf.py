"""GGUF file -> mlx-lm model directory.

`gguf_to_mlx_dir(path, out_dir)` writes `config.json` (Hugging Face style, with
mlx-lm's `quantization` block when weights are quantised), `model*.safetensors`
(weights under mlx-lm's names) and the tokenizer files, so the rest of mlx_flash
only ever reads mlx-lm / Hugging Face directories.

Weights (GGUF type -> what the mlx-lm directory stores)
  * Q4_0, Q4_1, Q8_0 -> MLX affine 4/8-bit, group 32 (.weight uint32, .scales, .biases) without any
    loss: these block formats are exactly affine per 32 values.
  * F32/F16/BF16 -> kept as they are.
  * Every other type (K-quants Q2_K..Q6_K, Q5_0, Q5_1, IQ*, ...) is dequantised with the `gguf`
    package and re-quantised to MLX 8-bit, group 32 (REQUANT). Relative RMS error against gguf's
    dequantised values, measured on random blocks (tests/test_gguf.py): Q2_K 2.9e-3, Q3_K 4.5e-3,
    Q4_K 1.5e-3, Q5_K 2.0e-3, Q6_K 4.5e-3, Q5_0 5.1e-3, IQ4_NL 4.0e-3 (8-bit group 64: about 1.3x
    more), a few percent of the source's own quantisation step, so the model keeps the GGUF's quality.
    4-bit re-quantisation is no option: MLX's grid differs from llama.cpp's (2.4e-2 for Q4_K at
    group 32), and a held-out measurement (issue #15) found Q4_K_M re-quantised to MLX 4-bit group
    64 at +41% perplexity, 8-bit lossless.
    Such tensors take 9 bits per weight instead of 4.5-6.6; 1-D ones become float16.
  * Files made only of the first kind and no larger than MX_LOAD_MAX_BYTES are
    read by `mx.load` (fast path). Other files are memory-mapped (_GGUFFile
    parses the header) and read a tensor at a time, each tensor spooled to disk
    as it is converted, so peak memory is about one tensor. Both paths write
    bit-identical weights.
  * llama.cpp's converter permutes the rows of attn_q / attn_k of llama-style
    models for its RoPE layout; the permutation is undone here (it commutes with
    per-row quantisation, so .weight/.scales/.biases rows are permuted alike).
    Qwen2/3, Phi-3 and Gemma 3 use NeoX-style RoPE and are stored unpermuted.
  * Gemma's RMSNorms compute x * (1 + w); llama.cpp stores every norm weight as
    w + 1 (ArchSpec.norm_shift), which is subtracted again.

Tokenizer
  GGUF keeps the tokenizer as metadata (tokens, merges or scores, token types,
  special ids, chat template). It is rebuilt with the `tokenizers` library and
  saved as a transformers PreTrainedTokenizerFast (no torch needed):
  * "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2): tokens + merges, with the
    pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`;
  * "llama" (SentencePiece BPE: Llama 2, Mistral, TinyLlama): byte-fallback BPE
    with merges derived from the scores, as transformers' LlamaTokenizerFast
    (legacy) does; a space is prefixed to each text run, also after special
    tokens, like llama.cpp.
  Control tokens become special tokens; BOS/EOS are added as the GGUF says.

Architectures are described by `ArchSpec` entries in `ARCHITECTURES` (GGUF
tensor names -> mlx-lm names, which rows to unpermute, norm offsets, and the
config builder); add an entry to support another one. Supported: llama (and
Mistral, which llama.cpp also calls "llama"), mistral, qwen2, qwen3, phi3
(fused attn_qkv and ffn_up -> qkv_proj / gate_up_proj) and gemma3 (->
gemma3_text, with llama.cpp's fixed defaults for what the GGUF leaves out:
sliding window pattern 6, local RoPE base 10000, query scale from head_dim).
Mixture of experts (stacked ffn_*_exps, router ffn_gate_inp): qwen3moe, qwen2moe (shared expert *_shexp),
olmoe, Mixtral (llama.cpp's "llama" with an expert_count), gpt-oss (MXFP4 experts kept as MLX mxfp4) and
deepseek2 (-> deepseek_v3: MLA in llama.cpp's k_b / v_b form, dense leading layers, shared experts).
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
from tqdm import tqdm

from ..errors import SourceError, UnsupportedArchitectureError
from ..safetensors_io import TensorSpool

GGUF_MAGIC = b"GGUF"
GGUF_GROUP_SIZE = 32  # block size of Q4_0 / Q4_1 / Q8_0 = MLX group size
DEFAULT_SHARD_BYTES = 2 << 30
MX_LOAD_MAX_BYTES = 128 << 20  # files up to this size are read whole by mx.load, larger ones a tensor at a time
_DTYPES = ("float16", "bfloat16", "float32")
# (group size, bits) of tensors MLX cannot hold exactly (K-quants, Q5_0/1, IQ*): 8-bit keeps them within
# 0.5% (RMS) of gguf's dequantisation; 4-bit re-quantisation costs far more (see the module docstring).
REQUANT = (32, 8)


# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------


def _rope_scaling(meta: "Meta", a: str, spec: "ArchSpec") -> Optional[dict]:
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling == "yarn" and spec.yarn:  # (mlx-lm's YarnRoPE, as llama.cpp: correction range floored/ceiled, mscale on q and k)
        if meta.float(f"{a}.rope.scaling.yarn_ext_factor", 1.0) != 1.0 or f"{a}.rope.scaling.yarn_attn_factor" in meta:
            raise UnsupportedArchitectureError(f"{meta.path}: YaRN with an ext_factor or attn_factor is not supported")
        yarn = {"rope_type": "yarn", "factor": meta.float(f"{a}.rope.scaling.factor"),
                "original_max_position_embeddings": meta.int(f"{a}.rope.scaling.original_context_length"),
                "beta_fast": meta.float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": meta.float(f"{a}.rope.scaling.yarn_beta_slow", 1.0)}
        if f"{a}.rope.scaling.yarn_log_multiplier" in meta:  # DeepSeek's: 0.1 * mscale_all_dim (the attention scale)
            m = float(f"{meta.float(f'{a}.rope.scaling.yarn_log_multiplier') / 0.1:.6g}")
            yarn.update(mscale=m, mscale_all_dim=m)
        return yarn
    if scaling != "linear":
        raise UnsupportedArchitectureError(f"{meta.path}: rope scaling {scaling!r} is not supported")
    return {"type": "linear", "factor": meta.float(f"{a}.rope.scaling.factor")}


def _base_config(meta: "Meta", shapes: Dict[str, Tuple[int, ...]], spec: "ArchSpec") -> dict:
    """The hyper-parameters every architecture here shares, from the GGUF metadata under "<arch>."."""
    a = meta["general.architecture"]
    hidden = meta.int(f"{a}.embedding_length")
    n_head = meta.int(f"{a}.attention.head_count")
    head_dim = meta.int(f"{a}.attention.key_length", hidden // n_head)
    if meta.int(f"{a}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with key_length != value_length is not supported")
    if not spec.head_dim_key and head_dim != hidden // n_head:  # the mlx-lm model derives head_dim itself
        raise UnsupportedArchitectureError(
            f"{meta.path}: {a} with head_dim {head_dim} != hidden_size / heads ({hidden // n_head}) is not supported"
        )
    rope_dim = meta.int(f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedArchitectureError(
            f"{meta.path}: partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) "
            f"are not supported for {a}"
        )
    if meta.get(f"{a}.expert_count", 0) and not spec.experts:
        raise UnsupportedArchitectureError(f"{meta.path}: mixture-of-experts {a} GGUFs are not supported")
    config = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.int(f"{a}.feed_forward_length", meta.int(f"{a}.expert_feed_forward_length", 0)),
        "num_hidden_layers": meta.int(f"{a}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": meta.int(f"{a}.attention.head_count_kv", n_head),
        "rms_norm_eps": meta.float(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_norm_eps),
        "rope_theta": meta.float(f"{a}.rope.freq_base", spec.rope_theta),
        "vocab_size": shapes["token_embd.weight"][0],
        "max_position_embeddings": meta.int(f"{a}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if spec.head_dim_key:
        config["head_dim"] = head_dim
    scaling = _rope_scaling(meta, a, spec)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _llama_config(meta, shapes, spec) -> dict:
    config = _base_config(meta, shapes, spec)
    config.update(
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in shapes,
        mlp_bias="blk.0.ffn_up.bias" in shapes,
    )
    return config


def _qwen_config(meta, shapes, spec) -> dict:
    config = _base_config(meta, shapes, spec)
    config["hidden_act"] = "silu"
    if spec.model_type in ("qwen2", "qwen2_moe") and "blk.0.attn_q.bias" not in shapes:  # mlx-lm's always has q/k/v biases
        raise UnsupportedArchitectureError(f"{meta.path}: {meta['general.architecture']} GGUF without attn_q/attn_k/attn_v biases")
    return config


def _qwen3_moe_config(meta, shapes, spec) -> dict:
    """Qwen3-MoE (llama.cpp "qwen3moe"): every layer's FFN is experts, top-k weights renormalised."""
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    if any(k.endswith("_shexp.weight") for k in shapes):
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with shared experts is not supported")
    config.update(hidden_act="silu", num_experts=meta.int(f"{a}.expert_count"),
                  num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
                  moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return config


def _qwen2_moe_config(meta, shapes, spec) -> dict:
    """Qwen1.5/2-MoE (llama.cpp "qwen2moe"): experts plus a shared expert behind a sigmoid gate; top-k weights not
    renormalised (mlx-lm's qwen2_moe, as the model)."""
    config = _qwen_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(num_experts=meta.int(f"{a}.expert_count"),
                  num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
                  moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
                  shared_expert_intermediate_size=meta.int(f"{a}.expert_shared_feed_forward_length"))
    return config


def _experts_config(meta, shapes, spec) -> dict:
    """Mixtral (llama.cpp writes it as "llama" with experts), OLMoE, gpt-oss: every layer's FFN is experts (of
    expert_feed_forward_length, else feed_forward_length), top-k weights as the model's class does them
    (renormalised in Mixtral, not in OLMoE)."""
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    count = "num_local_experts" if spec.model_type in ("mixtral", "gpt_oss") else "num_experts"
    config.update({count: meta.int(f"{a}.expert_count"), "num_experts_per_tok": meta.int(f"{a}.expert_used_count"),
                   "intermediate_size": meta.int(f"{a}.expert_feed_forward_length", meta.int(f"{a}.feed_forward_length", 0))})
    return config


def _gpt_oss_config(meta, shapes, spec) -> dict:
    """gpt-oss: experts with biases (MXFP4 in its GGUFs), attention sinks, sliding-window layers alternating with
    full ones (llama.cpp's pattern 2: even layers slide), YaRN."""
    config = _experts_config(meta, shapes, spec)
    n = config["num_hidden_layers"]
    config.update(sliding_window=meta.int(f"{meta['general.architecture']}.attention.sliding_window"),
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
    return config


def _deepseek2_config(meta, shapes, spec) -> dict:
    """DeepSeek-V3-style GGUFs (llama.cpp "deepseek2"): MLA attention stored as llama.cpp's absorbed form (k_b / v_b
    per head, key_length_mla / value_length_mla), leading dense layers, sigmoid routing with a correction bias
    (exp_probs_b) and expert groups, shared experts -> mlx-lm's deepseek_v3."""
    a = meta["general.architecture"]
    if meta.int(f"{a}.expert_gating_func", 2) != 2:
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with softmax routing (DeepSeek-V2) is not supported")
    if "blk.0.attn_kv_b.weight" not in shapes and f"{a}.attention.key_length_mla" not in meta:
        raise SourceError(f"{meta.path}: {a} without attention.key_length_mla")
    rope = meta.int(f"{a}.rope.dimension_count")
    config = {
        "architectures": [spec.hf_class], "model_type": spec.model_type,
        "hidden_size": meta.int(f"{a}.embedding_length"), "num_hidden_layers": meta.int(f"{a}.block_count"),
        "num_attention_heads": meta.int(f"{a}.attention.head_count"),
        "num_key_value_heads": meta.int(f"{a}.attention.head_count"),  # (the GGUF's 1: MQA over the latent)
        "intermediate_size": meta.int(f"{a}.feed_forward_length"),
        "moe_intermediate_size": meta.int(f"{a}.expert_feed_forward_length"),
        "n_routed_experts": meta.int(f"{a}.expert_count"), "num_experts_per_tok": meta.int(f"{a}.expert_used_count"),
        "n_shared_experts": meta.int(f"{a}.expert_shared_count", 0) or None,
        "first_k_dense_replace": meta.int(f"{a}.leading_dense_block_count", 0), "moe_layer_freq": 1,
        "routed_scaling_factor": meta.float(f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", False)),
        "n_group": meta.int(f"{a}.expert_group_count", 1), "topk_group": meta.int(f"{a}.expert_group_used_count", 1),
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "q_lora_rank": meta.int(f"{a}.attention.q_lora_rank", 0) or None,
        "kv_lora_rank": meta.int(f"{a}.attention.kv_lora_rank"), "qk_rope_head_dim": rope,
        "qk_nope_head_dim": meta.int(f"{a}.attention.key_length_mla", meta.int(f"{a}.attention.key_length", 0)) - rope,
        "v_head_dim": meta.int(f"{a}.attention.value_length_mla", meta.int(f"{a}.attention.value_length", 0)),
        "rms_norm_eps": meta.float(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_norm_eps),
        "rope_theta": meta.float(f"{a}.rope.freq_base", spec.rope_theta),
        "vocab_size": shapes["token_embd.weight"][0],
        "max_position_embeddings": meta.int(f"{a}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    scaling = _rope_scaling(meta, a, spec)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _phi3_config(meta, shapes, spec) -> dict:
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config["original_max_position_embeddings"] = meta.int(
        f"{a}.rope.scaling.original_context_length", config["max_position_embeddings"]
    )
    return config


def _gemma3_config(meta, shapes, spec) -> dict:
    """Gemma 3. What the GGUF leaves out comes from llama.cpp's llama_load_hparams_gemma3: every 6th
    layer global (sliding window pattern 6), local RoPE base 10000, and the attention scale
    1/sqrt(head_dim), except the 62-layer 27B's 1/sqrt(hidden / heads)."""
    a = meta["general.architecture"]
    config = _base_config(meta, shapes, spec)
    if meta.float(f"{a}.final_logit_softcapping", 0.0) or meta.float(f"{a}.attn_logit_softcapping", 0.0):
        raise UnsupportedArchitectureError(f"{meta.path}: gemma3 with logit soft-capping is not supported by mlx-lm")
    if config.pop("rope_scaling", None) is not None:  # llama.cpp scales the global layers' RoPE only
        config["rope_scaling"] = {"rope_type": "linear", "factor": meta.float(f"{a}.rope.scaling.factor")}
    n_layers, hidden, n_head = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=meta.int(f"{a}.attention.sliding_window"),
        sliding_window_pattern=6,  # fixed in llama.cpp, whatever the metadata says
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=hidden // n_head if n_layers == 62 else config["head_dim"],
    )
    return config


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto an mlx-lm model."""

    model_type: str
    hf_class: str  # config.json "architectures"
    # per-block GGUF base name -> mlx-lm path below model.layers.N
    block_names: Dict[str, str]
    make_config: Callable[["Meta", Dict[str, Tuple[int, ...]], "ArchSpec"], dict]
    # per-block GGUF base name -> metadata key (after "<arch>.") of the head count used by llama.cpp's RoPE
    # permutation (llama-style "normal" RoPE only; NeoX-style models are stored unpermuted)
    permuted: Dict[str, str] = field(default_factory=dict)
    # llama.cpp stores every RMSNorm weight ("*norm" tensors) as w + norm_shift (Gemma's norms compute x * (1 + w))
    norm_shift: float = 0.0
    head_dim_key: bool = True  # the mlx-lm config takes "head_dim" (else it is hidden_size / heads)
    rms_norm_eps: float = 1e-5  # llama.cpp's default when the GGUF has none
    rope_theta: float = 10000.0
    # GGUF base name -> mlx-lm module path, outside the blocks
    global_names: Dict[str, str] = field(
        default_factory=lambda: {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    )
    # GGUF tensors this spec cannot represent (with the reason), e.g. llama3 rope_freqs
    rejected: Dict[str, str] = field(default_factory=dict)
    experts: bool = False  # a mixture-of-experts model (its GGUF has <arch>.expert_count)
    # per-block GGUF base names stored 1-D that are a Linear's one row in mlx-lm (qwen2moe's shared-expert gate)
    row_vectors: Tuple[str, ...] = ()
    # per-block GGUF base names whose "weight" is a bare parameter in mlx-lm (gpt-oss's attention sinks)
    bare: Tuple[str, ...] = ()
    yarn: bool = False  # YaRN RoPE scaling maps onto mlx-lm's (checked against llama.cpp: benchmarks/moe_gguf_check.py)


_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SWIGLU = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = {"rope_freqs": "llama-3.1 style rope frequency factors (rope_freqs) are not supported yet"}
_LLAMA = ArchSpec(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    block_names={**_ATTENTION, **_SWIGLU},
    make_config=_llama_config,
    permuted={"attn_q": "attention.head_count", "attn_k": "attention.head_count_kv"},
    rejected=_ROPE_FREQS,
)

_EXPERTS = {"ffn_gate_exps": "switch_mlp.gate_proj", "ffn_up_exps": "switch_mlp.up_proj", "ffn_down_exps": "switch_mlp.down_proj"}
# llama.cpp's "llama" with expert_count (and stacked ffn_*_exps: GGUFs from before mid-2024 hold an
# ffn_gate.E tensor per expert, refused as unmapped)
_MIXTRAL = ArchSpec(
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    block_names={**_ATTENTION, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "block_sparse_moe.gate",
                 **{k: f"block_sparse_moe.{v}" for k, v in _EXPERTS.items()}},
    make_config=_experts_config,
    permuted=_LLAMA.permuted,
    head_dim_key=False,
    rope_theta=1e6,
    rejected=_ROPE_FREQS,
    experts=True,
)

ARCHITECTURES: Dict[str, ArchSpec] = {
    "llama": _LLAMA,  # also Mistral 7B: llama.cpp converts it as "llama"
    "mistral": _LLAMA,
    "qwen2": ArchSpec(
        model_type="qwen2",
        hf_class="Qwen2ForCausalLM",
        block_names={**_ATTENTION, **_SWIGLU},
        make_config=_qwen_config,
        head_dim_key=False,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rejected=_ROPE_FREQS,
    ),
    "qwen3": ArchSpec(
        model_type="qwen3",
        hf_class="Qwen3ForCausalLM",
        block_names={**_ATTENTION, **_QK_NORM, **_SWIGLU},
        make_config=_qwen_config,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rejected=_ROPE_FREQS,
    ),
    "qwen3moe": ArchSpec(
        model_type="qwen3_moe",
        hf_class="Qwen3MoeForCausalLM",
        block_names={**_ATTENTION, **_QK_NORM, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
                     **{k: f"mlp.{v}" for k, v in _EXPERTS.items()}},
        make_config=_qwen3_moe_config,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rejected=_ROPE_FREQS,
        experts=True,
    ),
    "qwen2moe": ArchSpec(
        model_type="qwen2_moe",
        hf_class="Qwen2MoeForCausalLM",
        block_names={**_ATTENTION, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
                     **{k: f"mlp.{v}" for k, v in _EXPERTS.items()}, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                     "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                     "ffn_down_shexp": "mlp.shared_expert.down_proj"},
        make_config=_qwen2_moe_config,
        head_dim_key=False,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rejected=_ROPE_FREQS,
        experts=True,
        row_vectors=("ffn_gate_inp_shexp",),
    ),
    "olmoe": ArchSpec(  # (NeoX RoPE: stored unpermuted; q/k norms over all heads)
        model_type="olmoe",
        hf_class="OlmoeForCausalLM",
        block_names={**_ATTENTION, **_QK_NORM, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
                     **{k: f"mlp.{v}" for k, v in _EXPERTS.items()}},
        make_config=_experts_config,
        rejected=_ROPE_FREQS,
        experts=True,
    ),
    "gpt-oss": ArchSpec(  # (NeoX RoPE: stored unpermuted)
        model_type="gpt_oss",
        hf_class="GptOssForCausalLM",
        block_names={**_ATTENTION, "attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm",
                     "ffn_gate_inp": "mlp.router",
                     **{k: v.replace("switch_mlp", "mlp.experts") for k, v in _EXPERTS.items()}},
        make_config=_gpt_oss_config,
        rope_theta=150000.0,
        experts=True,
        bare=("attn_sinks",),
        yarn=True,
    ),
    "deepseek2": ArchSpec(  # (RoPE on adjacent pairs, as mlx-lm's traditional=True: stored unpermuted)
        model_type="deepseek_v3",
        hf_class="DeepseekV3ForCausalLM",
        block_names={
            "attn_norm": "input_layernorm",
            "attn_q": "self_attn.q_proj",
            "attn_q_a": "self_attn.q_a_proj",
            "attn_q_a_norm": "self_attn.q_a_layernorm",
            "attn_q_b": "self_attn.q_b_proj",
            "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
            "attn_kv_a_norm": "self_attn.kv_a_layernorm",
            "attn_kv_b": "self_attn.kv_b_proj",  # (older GGUFs; mlx-lm's sanitize splits it)
            "attn_k_b": "self_attn.embed_q",
            "attn_v_b": "self_attn.unembed_out",
            "attn_output": "self_attn.o_proj",
            **_SWIGLU,  # the leading dense layers (and every layer's ffn_norm)
            "ffn_gate_inp": "mlp.gate",
            "exp_probs_b": "mlp.gate.e_score_correction_bias",
            **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
            "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
            "ffn_up_shexp": "mlp.shared_experts.up_proj",
            "ffn_down_shexp": "mlp.shared_experts.down_proj",
        },
        make_config=_deepseek2_config,
        rms_norm_eps=1e-6,
        experts=True,
        bare=("exp_probs_b",),
        yarn=True,
    ),
    "gemma3": ArchSpec(
        model_type="gemma3_text",
        hf_class="Gemma3ForCausalLM",
        block_names={
            **_ATTENTION,
            **_QK_NORM,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        make_config=_gemma3_config,
        norm_shift=1.0,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    ),
    "phi3": ArchSpec(
        model_type="phi3",
        hf_class="Phi3ForCausalLM",
        block_names={
            "attn_norm": "input_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_norm": "post_attention_layernorm",
            "ffn_up": "mlp.gate_up_proj",  # gate and up fused, gate rows first, as in Phi-3's gate_up_proj
            "ffn_down": "mlp.down_proj",
        },
        make_config=_phi3_config,
        head_dim_key=False,
        rejected={
            name: "Phi-3 long-context rope factors (rope_factors_long/short) are not supported yet"
            for name in ("rope_factors_long", "rope_factors_short")
        },
    ),
}


def _arch_spec(arch: Optional[str], meta: "Meta") -> ArchSpec:
    path = meta.path
    spec = _MIXTRAL if arch == "llama" and meta.get("llama.expert_count", 0) else ARCHITECTURES.get(arch)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return spec


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _map_name(spec: ArchSpec, base: str) -> Tuple[Optional[str], Optional[str]]:
    """GGUF base name -> (mlx-lm module path, permutation head-count key or None). (None, None) if unknown."""
    if base in spec.global_names:
        return spec.global_names[base], None
    m = _BLOCK_RE.match(base)
    if m and m.group(2) in spec.block_names:
        return f"model.layers.{m.group(1)}.{spec.block_names[m.group(2)]}", spec.permuted.get(m.group(2))
    return None, None


# --------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------


class Meta(dict):
    """GGUF key/value metadata as plain Python values, plus typed getters with clear errors."""

    def __init__(self, values: dict, path: Path):
        super().__init__(values)
        self.path = path

    def _required(self, key):
        if key not in self:
            raise SourceError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self[key]

    def int(self, key, default=None) -> int:
        v = self._required(key) if default is None else self.get(key, default)
        if isinstance(v, (list, tuple)):  # per-layer values (e.g. head_count_kv of some models)
            if not v or any(x != v[0] for x in v):
                raise UnsupportedArchitectureError(f"{self.path}: per-layer {key} ({v[:8]}...) is not supported")
            v = v[0]
        return int(v)

    def float(self, key, default=None) -> float:
        v = float(self._required(key) if default is None else self.get(key, default))
        return float(f"{v:.7g}")  # GGUF floats are float32: 9.999999747e-06 -> 1e-05


def _plain(v):
    import mlx.core as mx

    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types a GGUF stores as plain numbers (any other is blocks of bytes)
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


@dataclass
class _TensorInfo:
    """One tensor of a GGUF file (as gguf.ReaderTensor): its data is a view of the file's memory map."""

    name: str
    shape: Tuple[int, ...]  # GGUF order (fastest-varying dimension first)
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    file: np.ndarray

    @property
    def data(self) -> np.ndarray:
        dims = tuple(reversed(self.shape))
        raw = self.file[self.data_offset : self.data_offset + self.n_bytes]
        if self.tensor_type.name in _PLAIN:
            return raw.view(_PLAIN[self.tensor_type.name]).reshape(dims)
        import gguf

        return raw.reshape(gguf.quant_shape_to_byte_shape(dims, self.tensor_type))


class _GGUFFile:
    """A GGUF file's metadata (plain Python values) and tensor infos, parsed straight from its memory map (the
    gguf package's reader keeps a numpy view per metadata item: hundreds of MB and seconds for a large vocabulary)."""

    def __init__(self, path: Path):
        import gguf

        self.data = np.memmap(path, mode="r")
        self._buf, self._pos = memoryview(self.data), 0
        if bytes(self._read(4)) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.fields = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            shape = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, shape, gguf.GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid alignment {align}")
        start = -(-self._pos // align) * align
        self.tensors = []
        for name, shape, qtype, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(shape)) // block * size
            if start + offset + n_bytes > len(self.data):
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors.append(_TensorInfo(name, shape, qtype, start + offset, n_bytes, self.data))
        del self._buf

    def _read(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise ValueError("unexpected end of file in the header (truncated?)")
        self._pos += n
        return self._buf[self._pos - n : self._pos]

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return str(self._read(self._unpack("<Q")), "utf-8")

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            kind, n = self._unpack("<I"), self._unpack("<Q")
            if kind in _SCALARS and kind != 7:
                dtype = np.dtype(_SCALARS[kind])
                return np.frombuffer(self._read(n * dtype.itemsize), dtype).tolist()
            return [self._value(kind) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(_SCALARS[kind])


# --------------------------------------------------------------------------------------
# Tensor sources: each yields (gguf base name, part, {"weight"/"scales"/"biases"/"bias": mx.array}, quant)
# with quant = (group_size, bits) for MLX-quantised weights, else None.
# --------------------------------------------------------------------------------------

Tensor = Tuple[str, str, Dict[str, object], Optional[Tuple[int, int]]]


def _split_name(name: str) -> Tuple[str, str]:
    base, _, part = name.rpartition(".")
    if part in ("weight", "bias") and base:
        return base, part
    return name, "weight"


def _iter_mx(arrays: dict) -> Iterator[Tensor]:
    for name in sorted(arrays):
        if name.endswith((".scales", ".biases")):
            continue
        base, part = _split_name(name)
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        if f"{stem}.scales" in arrays:
            w, s, b = arrays[name], arrays[f"{stem}.scales"], arrays[f"{stem}.biases"]
            bits = w.shape[-1] // s.shape[-1]  # mx.load always uses 32-value groups for GGUF blocks
            yield base, part, {"weight": w, "scales": s, "biases": b}, (GGUF_GROUP_SIZE, bits)
        else:
            yield base, part, {part: arrays[name]}, None


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16)


def _repack_q8_0(raw: np.ndarray):
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 34)
    d = _f16(b[..., :2])[..., 0]
    q = np.ascontiguousarray(b[..., 2:]) ^ np.uint8(0x80)  # int8 two's complement -> q + 128
    return q.reshape(rows, -1).view(np.uint32), d, (d.astype(np.float32) * -128).astype(np.float16), 8


def _repack_q4(raw: np.ndarray, block: int):
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, block)
    d = _f16(b[..., :2])[..., 0]
    if block == 18:  # Q4_0: w = d * (q - 8)
        bias = (d.astype(np.float32) * -8).astype(np.float16)
        qs = b[..., 2:]
    else:  # Q4_1: w = d * q + m
        bias = _f16(b[..., 2:4])[..., 0]
        qs = b[..., 4:]
    return _mlx_nibbles(qs), d, bias, 4


def _mlx_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 4-bit blocks' 16 code bytes [rows, blocks, 16] -> MLX's packing, uint32 [rows, blocks * 4]."""
    # GGUF: byte j holds value j (low nibble) and value j + 16 (high nibble).
    vals = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    # MLX: byte j holds value 2j (low nibble) and 2j + 1 (high nibble), little-endian uint32 words.
    packed = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed).reshape(qs.shape[0], -1).view(np.uint32)


def _repack_mxfp4(raw: np.ndarray):
    """GGML MXFP4 (17 B per 32: an e8m0 scale byte, then Q4_0's nibble order) -> MLX mxfp4: the same e2m1 codes
    and the same scale byte (2^(e - 127)); only the nibbles are reordered."""
    b = raw.reshape(raw.shape[0], -1, 17)
    return _mlx_nibbles(b[..., 1:]), np.ascontiguousarray(b[..., 0]), None, 4


def _dequantize(raw: np.ndarray, t, path: Path) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.dequantize(raw, t.tensor_type)
    except NotImplementedError:
        raise SourceError(
            f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf package cannot dequantise"
        ) from None


def _requantize(raw: np.ndarray, t, path: Path, chunk_values: int = 1 << 24) -> Dict[str, object]:
    """Rows of blocks of a GGUF type MLX has no exact equivalent of -> MLX affine REQUANT (8-bit, group 32),
    dequantised a few rows at a time so that only a chunk is ever held in float32."""
    import mlx.core as mx

    rows_per_chunk = max(1, chunk_values * raw.shape[1] // raw.size)
    parts = []
    for i in range(0, raw.shape[0], rows_per_chunk):
        w = mx.array(_dequantize(raw[i : i + rows_per_chunk], t, path).astype(np.float32))
        q, scales, biases = mx.quantize(w, group_size=REQUANT[0], bits=REQUANT[1])
        parts.append((q, scales.astype(mx.float16), biases.astype(mx.float16)))
        mx.eval(parts[-1])
    return {k: mx.concatenate([p[j] for p in parts]) for j, k in enumerate(("weight", "scales", "biases"))}


def _iter_reader(reader, path: Path) -> Iterator[Tensor]:
    import gguf

    T = gguf.GGMLQuantizationType
    repack = {
        T.Q8_0: _repack_q8_0,
        T.Q4_0: lambda raw: _repack_q4(raw, 18),
        T.Q4_1: lambda raw: _repack_q4(raw, 20),
        T.MXFP4: _repack_mxfp4,
    }
    for t in reader.tensors:
        yield _read_tensor(t, T, repack, path)
        _drop_pages(reader.data, t.data_offset, t.n_bytes)


def _read_tensor(t, T, repack, path: Path) -> Tensor:
    import mlx.core as mx

    base, part = _split_name(t.name)
    shape = tuple(int(x) for x in reversed(t.shape))
    raw = t.data
    if t.tensor_type in repack and len(shape) in (2, 3) and part == "weight":  # 3-D: stacked experts
        w, s, b, bits = _by_rows(repack[t.tensor_type], np.asarray(raw).reshape(int(np.prod(shape[:-1])), -1))
        arrays = {"weight": w, "scales": s, **({} if b is None else {"biases": b})}  # (mxfp4: no biases)
        return base, part, {k: mx.array(a.reshape(*shape[:-1], -1)) for k, a in arrays.items()}, (GGUF_GROUP_SIZE, bits)
    if t.tensor_type == T.F32:
        arr = mx.array(np.asarray(raw, dtype=np.float32).reshape(shape))
    elif t.tensor_type == T.F16:
        arr = mx.array(np.asarray(raw, dtype=np.float16).reshape(shape))
    elif t.tensor_type == T.BF16:
        bits16 = np.ascontiguousarray(raw).view(np.uint16).reshape(shape)
        arr = mx.array(bits16).view(mx.bfloat16)
    elif len(shape) == 2 and part == "weight" and shape[1] % GGUF_GROUP_SIZE == 0:
        return base, part, _requantize(np.asarray(raw).reshape(shape[0], -1), t, path), REQUANT
    else:
        arr = mx.array(_dequantize(np.asarray(raw), t, path).reshape(shape).astype(np.float16))
    return base, part, {part: arr}, None


def _by_rows(repack, raw: np.ndarray, chunk_bytes: int = 1 << 24):
    """`repack` over a few rows of blocks at a time (its temporaries are several times its input), joined."""
    rows = max(1, chunk_bytes // raw.shape[1])
    if raw.shape[0] <= rows:
        return repack(raw)
    out = None
    for i in range(0, raw.shape[0], rows):
        *parts, bits = repack(raw[i : i + rows])
        if out is None:
            out = [None if p is None else np.empty((raw.shape[0], *p.shape[1:]), p.dtype) for p in parts]
        for o, p in zip(out, parts):
            if o is not None:
                o[i : i + len(p)] = p
    return (*out, bits)


def _drop_pages(data: np.ndarray, offset: int, nbytes: int) -> None:
    """Unmap a tensor's pages of the memory-mapped file once it is read: the process's resident set stays about one
    tensor (the pages stay in the page cache, and are read again if touched)."""
    m = getattr(data, "_mmap", None)
    if m is None or not hasattr(m, "madvise") or getattr(data, "offset", 0) != 0:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    m.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(m)) - start)


# --------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------


def _check_file(path: Path) -> None:
    if not path.exists():
        raise SourceError(f"{path}: no such GGUF file")
    if not path.is_file():
        raise SourceError(f"{path}: not a file (expected a .gguf file)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise SourceError(f"{path}: cannot be read ({e})") from e
    if len(magic) < 4:
        raise SourceError(f"{path}: not a GGUF file (only {len(magic)} bytes long)")
    if magic != GGUF_MAGIC:
        raise SourceError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")


class _MxSource:
    """Whole file through mx.load: fast, but every tensor is held in memory at once."""

    def __init__(self, arrays: dict, meta: dict):
        self.arrays, self.meta = arrays, meta

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        out = {}
        for base, part, arrays, quant in _iter_mx(self.arrays):
            a = arrays["weight"] if quant is not None else arrays[part]
            shape = tuple(a.shape)
            if quant is not None:
                shape = shape[:-1] + (shape[-1] * 32 // quant[1],)
            out[f"{base}.{part}"] = shape
        return out

    def tensors(self) -> Iterator[Tensor]:
        return _iter_mx(self.arrays)

    def sizes(self) -> Dict[str, int]:
        return {f"{base}.{part}": sum(a.nbytes for a in arrays.values()) for base, part, arrays, _ in _iter_mx(self.arrays)}


class _ReaderSource:
    """File memory-mapped (_GGUFFile): any tensor type, one tensor in memory at a time."""

    def __init__(self, reader, meta: dict):
        self.reader, self.meta = reader, meta

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        out = {}
        for t in self.reader.tensors:
            base, part = _split_name(t.name)
            out[f"{base}.{part}"] = tuple(int(x) for x in reversed(t.shape))
        return out

    def tensors(self) -> Iterator[Tensor]:
        return _iter_reader(self.reader, self.meta.path)

    def sizes(self) -> Dict[str, int]:
        """Bytes of each tensor in the file."""
        return {"%s.%s" % _split_name(t.name): int(t.n_bytes) for t in self.reader.tensors}


def _tensor_count(path: Path) -> int:
    """The tensor count of a GGUF's header (magic, version, then the count as uint64)."""
    with open(path, "rb") as f:
        f.seek(8)
        return int.from_bytes(f.read(8), "little")


def _open(path: Path, force_reader: bool, mx_load_max_bytes: int):
    """mx.load for files up to `mx_load_max_bytes` whose tensors it can all read, else _GGUFFile.

    Damaged files -> SourceError.
    """
    mx_error = None
    if not force_reader and path.stat().st_size <= mx_load_max_bytes:
        import mlx.core as mx

        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            loaded = sum(not k.endswith((".scales", ".biases")) for k in arrays)
            if loaded == _tensor_count(path):  # (mx.load stops at a type it cannot read, e.g. MXFP4, and says nothing)
                return _MxSource(arrays, Meta({k: _plain(v) for k, v in meta.items()}, path))
        except Exception as e:  # an unsupported tensor type, or a damaged file: the reader tells which
            mx_error = e
    try:
        reader = _GGUFFile(path)
        meta = Meta(reader.fields, path)
    except Exception as e:
        detail = mx_error if mx_error is not None else e
        raise SourceError(
            f"{path}: cannot read the GGUF file (truncated or corrupted?): {type(detail).__name__}: {detail}"
        ) from e
    return _ReaderSource(reader, meta)


def _unpermute(a, n_head: int):
    """Undo llama.cpp's RoPE row permutation on the rows (axis 0) of `a`."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise SourceError(f"cannot unpermute {rows} rows over {n_head} heads")
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


class _ShardWriter:
    """Shards of about `shard_bytes`, each array spooled to a scratch file as it is added (memory: one array)
    and the shard written when full, byte for byte as mx.save_safetensors writes it."""

    def __init__(self, out_dir: Path, shard_bytes: int):
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.spool: Optional[TensorSpool] = None
        self.shards: List[List[str]] = []  # tensor names of each written shard
        self.files: List[Path] = []

    def add(self, name: str, arr) -> None:
        if self.spool is not None and self.spool.nbytes + arr.nbytes > self.shard_bytes:
            self.flush()
        if self.spool is None:
            self.spool = TensorSpool(self.out_dir / ".tmp-model.spool")
        self.spool.add(name, arr)

    def flush(self) -> None:
        if self.spool is None:
            return
        f = self.out_dir / f".tmp-model-{len(self.files) + 1:05d}.safetensors"  # not matched by model*.safetensors
        self.shards.append(sorted(self.spool.entries))
        self.spool.save(f, metadata={"format": "mlx"})
        self.files.append(f)
        self.spool = None

    def close(self) -> int:
        self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map, total = {}, 0
        for f, name, keys in zip(self.files, names, self.shards):
            total += f.stat().st_size
            f.replace(self.out_dir / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            with open(self.out_dir / "model.safetensors.index.json", "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
        return total


def _clear_old_outputs(out_dir: Path) -> None:
    for pattern in ("model*.safetensors", ".tmp-model-*.safetensors", ".tmp-model.spool", "model.safetensors.index.json"):
        for f in out_dir.glob(pattern):
            f.unlink()


def gguf_to_mlx_dir(
    gguf_path,
    out_dir,
    *,
    dtype: Optional[str] = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
    _unpermute_qk: bool = True,
    _force_reader: bool = False,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory at `out_dir` and return its path.

    `dtype` ("float16", "bfloat16", "float32") casts every float tensor (scales and biases of
    quantised weights, norms, unquantised weights); by default they keep the GGUF's dtypes and
    re-quantised tensors (see the module docstring) have float16 scales. Weights are written in shards of about
    `shard_bytes` (one `model.safetensors` when they fit), a tensor at a time: memory holds about one tensor
    whatever the file's size. `progress`: a bar of the bytes read. Files in `out_dir` other than the
    ones written here are left alone, except older `model*.safetensors` shards, which are removed.

    Raises SourceError for a missing / non-GGUF / damaged file or unreadable metadata, and
    UnsupportedArchitectureError for architectures (or architecture variants) without a mapping.
    `_unpermute_qk=False` and `_force_reader=True` are for tests only.
    """
    import mlx.core as mx

    path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser()
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    cast = getattr(mx, dtype) if dtype is not None else None
    _check_file(path)
    if progress:
        print(f"{path.name}: reading the header and tokenizer ({path.stat().st_size / 2**30:.2f} GiB file)",
              file=sys.stderr, flush=True)
    # Small files: mx.load (fast, holds everything). Others: the reader's memory map, a tensor at a time.
    source = _open(path, _force_reader, mx_load_max_bytes=MX_LOAD_MAX_BYTES)
    meta = source.meta
    arch = meta.get("general.architecture")
    spec = _arch_spec(arch, meta)

    shapes = source.shapes()
    unknown = []
    for name in shapes:
        base, _ = _split_name(name)
        if base in spec.rejected:
            raise UnsupportedArchitectureError(f"{path}: {spec.rejected[base]}")
        if _map_name(spec, base)[0] is None:
            unknown.append(name)
    if unknown:
        raise UnsupportedArchitectureError(
            f"{path}: {len(unknown)} tensor(s) with no mapping for GGUF architecture {arch!r}: "
            f"{', '.join(sorted(unknown)[:8])}"
        )
    if "token_embd.weight" not in shapes:
        raise SourceError(f"{path}: no token_embd.weight tensor")
    config = spec.make_config(meta, shapes, spec)
    tokenizer = build_tokenizer(meta)

    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_old_outputs(out_dir)
    writer = _ShardWriter(out_dir, shard_bytes)
    quant_of: Dict[str, Tuple[int, int]] = {}
    sizes = source.sizes()
    bar = tqdm(total=sum(sizes.values()), desc=f"read {path.name}", unit="B", unit_scale=True, unit_divisor=1024,
               disable=not progress)
    for base, part, arrays, quant in source.tensors():
        hf, head_key = _map_name(spec, base)
        if head_key is not None and _unpermute_qk:
            n_head = meta.int(f"{arch}.{head_key}", meta.int(f"{arch}.attention.head_count"))
            arrays = {k: _unpermute(v, n_head) for k, v in arrays.items()}
        if base.rpartition(".")[2] in spec.row_vectors:
            arrays = {k: v.reshape(1, -1) for k, v in arrays.items()}
        if spec.norm_shift and base.endswith("norm"):
            arrays = {k: v - spec.norm_shift for k, v in arrays.items()}
        if cast is not None:
            arrays = {k: v.astype(cast) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in arrays.items()}
        if quant is not None:  # uint8 scales: mxfp4 (as mlx-lm infers it)
            quant_of[hf] = (*quant, "mxfp4" if arrays["scales"].dtype == mx.uint8 else "affine")
        for key, arr in arrays.items():
            writer.add(hf if base.rpartition(".")[2] in spec.bare else f"{hf}.{key}", arr)
        bar.update(sizes[f"{base}.{part}"])
    writer.close()
    bar.close()

    if quant_of:
        def entry(q):
            return {"group_size": q[0], "bits": q[1], **({"mode": q[2]} if q[2] != "affine" else {})}

        common, _ = Counter(quant_of.values()).most_common(1)[0]
        quantization = entry(common)
        for hf, q in sorted(quant_of.items()):
            if q != common:
                quantization[hf] = entry(q)
        config["quantization"] = quantization
        config["quantization_config"] = dict(quantization)

    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    with open(out_dir / "config.json", "w") as f:
        json.dump(dict(sorted(config.items())), f, indent=2)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump(gen, f, indent=2)
    tokenizer.save_pretrained(str(out_dir))
    # without indentation: the GGUF keeps its vocabulary compactly, and pretty-printed it took 2.3x the bytes
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    _portable_tokenizer_config(out_dir, tokenizer)
    return out_dir


def _portable_tokenizer_config(out_dir: Path, tokenizer) -> None:
    """Name the class transformers 4.x and 5.x both know, and keep the chat template in the config too."""
    p = out_dir / "tokenizer_config.json"
    with open(p) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    with open(p, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

# GPT-2's split regex (the default of tokenizers' ByteLevel pre-tokenizer).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer recipe, following llama.cpp's llama-vocab.cpp regexes.
_PRE_TOKENIZERS = {
    # "\p{N}" isolated, then the GPT-2 regex == Digits(individual_digits) + ByteLevel (SmolLM2's tokenizer.json)
    **{k: "digits+gpt2" for k in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")},
    **{k: "gpt2" for k in ("gpt-2", "gpt2", "default", "mpt", "olmo", "jais")},
    **{k: "llama3" for k in ("llama-bpe", "llama3", "smaug-bpe", "dbrx")},
    **{k: "qwen2" for k in ("qwen2", "stablelm2")},
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    regex = {"llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}[kind]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _gpt2_model(meta: Meta, tokens: List[str], vocab: Dict[str, int]):
    """Byte-level BPE (tokenizer.ggml.model == "gpt2") from tokens + merges."""
    from tokenizers import Tokenizer, decoders, models, processors

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise SourceError(
            f"{meta.path}: pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    pairs = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        a, sep, b = m.partition(" ")
        if not sep:
            raise SourceError(f"{meta.path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, False


def _spm_merges(vocab: Dict[str, int], scores: List[float]) -> List[Tuple[str, str]]:
    """BPE merges that reproduce a SentencePiece BPE model: every split of a piece into two pieces,
    ranked by the merged piece's score (what transformers' SentencePieceExtractor does)."""
    merges = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], -len(left), -len(right), i, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[-2], m[-1]) for m in merges]


def _spm_model(meta: Meta, tokens: List[str], vocab: Dict[str, int]):
    """SentencePiece BPE (tokenizer.ggml.model == "llama", Llama 1/2, Mistral, TinyLlama) as a
    byte-fallback BPE, the way transformers' LlamaTokenizerFast (legacy) does it."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(x) for x in (meta.get("tokenizer.ggml.scores") or [])]
    if len(scores) != len(tokens):
        raise SourceError(f"{meta.path}: SentencePiece tokenizer without one score per token (tokenizer.ggml.scores)")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=_spm_merges(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, True


_TOKENIZER_MODELS = {"gpt2": _gpt2_model, "llama": _spm_model}


def build_tokenizer(meta: Meta):
    """transformers.PreTrainedTokenizerFast rebuilt from GGUF tokenizer metadata."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    path = meta.path
    model = meta.get("tokenizer.ggml.model")
    if model not in _TOKENIZER_MODELS:
        raise SourceError(
            f"{path}: tokenizer model {model!r} is not supported (supported: {', '.join(sorted(_TOKENIZER_MODELS))})"
        )
    tokens = [str(t) for t in (meta.get("tokenizer.ggml.tokens") or [])]
    if not tokens:
        raise SourceError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    vocab: Dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # keep the first id of a duplicated string
    tok, add_bos_default = _TOKENIZER_MODELS[model](meta, tokens, vocab)

    added = [
        AddedToken(t, special=ty != _TOKEN_USER_DEFINED, normalized=False, single_word=False, lstrip=False, rstrip=False)
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED) and vocab.get(t) == i
    ]
    if added:
        tok.add_tokens(added)

    def special(name):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        specials = ([(bos, vocab[bos])] if add_bos else []) + ([(eos, vocab[eos])] if add_eos and eos != bos else [])
        tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)

    kwargs = dict(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        clean_up_tokenization_spaces=False,
        chat_template=meta.get("tokenizer.chat_template") or None,
    )
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if ctx:
        kwargs["model_max_length"] = int(ctx)
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
