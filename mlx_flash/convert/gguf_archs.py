"""GGUF architectures: how a GGUF's tensor names and metadata map onto an mlx-lm model and its config (see
gguf.py for the reading and the supported list), and the metadata's typed getters."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from ..errors import SourceError, UnsupportedArchitectureError

# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------


def _rope_scaling(meta: "Meta", a: str, spec: "ArchSpec") -> Optional[dict]:
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if (
        scaling == "yarn" and spec.yarn
    ):  # (mlx-lm's YarnRoPE, as llama.cpp: correction range floored/ceiled, mscale on q and k)
        if meta.float(f"{a}.rope.scaling.yarn_ext_factor", 1.0) != 1.0 or f"{a}.rope.scaling.yarn_attn_factor" in meta:
            raise UnsupportedArchitectureError(f"{meta.path}: YaRN with an ext_factor or attn_factor is not supported")
        yarn = {
            "rope_type": "yarn",
            "factor": meta.float(f"{a}.rope.scaling.factor"),
            "original_max_position_embeddings": meta.int(f"{a}.rope.scaling.original_context_length"),
            "beta_fast": meta.float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.float(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
        }
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
    n_kv_head = meta.int(f"{a}.attention.head_count_kv", n_head)
    if min(hidden, n_head, n_kv_head) < 1:  # (divisors below and in the RoPE unpermutation)
        raise SourceError(
            f"{meta.path}: embedding_length {hidden}, head_count {n_head}, head_count_kv {n_kv_head}: not all positive"
        )
    head_dim = meta.int(f"{a}.attention.key_length", hidden // n_head)
    if meta.int(f"{a}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with key_length != value_length is not supported")
    if not spec.head_dim_key and head_dim != hidden // n_head:  # the mlx-lm model derives head_dim itself
        raise UnsupportedArchitectureError(
            f"{meta.path}: {a} with head_dim {head_dim} != hidden_size / heads ({hidden // n_head}) is not supported"
        )
    rope_dim = meta.int(f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim and not spec.partial_rotary:
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
        "num_hidden_layers": meta.int(f"{a}.block_count") - mtp_blocks(spec, meta),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "rms_norm_eps": meta.float(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_norm_eps),
        "rope_theta": meta.float(f"{a}.rope.freq_base", spec.rope_theta),
        "vocab_size": shapes["token_embd.weight"][0],
        "max_position_embeddings": meta.int(f"{a}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if spec.head_dim_key:
        config["head_dim"] = head_dim
    if spec.partial_rotary == "rotary_dim":
        config["rotary_dim"] = rope_dim
    elif spec.partial_rotary:
        config[spec.partial_rotary] = rope_dim / head_dim
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
    if (
        spec.model_type in ("qwen2", "qwen2_moe") and "blk.0.attn_q.bias" not in shapes
    ):  # mlx-lm's always has q/k/v biases
        raise UnsupportedArchitectureError(
            f"{meta.path}: {meta['general.architecture']} GGUF without attn_q/attn_k/attn_v biases"
        )
    return config


def _qwen3_moe_config(meta, shapes, spec) -> dict:
    """Qwen3-MoE (llama.cpp "qwen3moe"): every layer's FFN is experts, top-k weights renormalised."""
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    if any(k.endswith("_shexp.weight") for k in shapes):
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with shared experts is not supported")
    config.update(
        hidden_act="silu",
        num_experts=meta.int(f"{a}.expert_count"),
        num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
        moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    return config


def _qwen2_moe_config(meta, shapes, spec) -> dict:
    """Qwen1.5/2-MoE (llama.cpp "qwen2moe"): experts plus a shared expert behind a sigmoid gate; top-k weights not
    renormalised (mlx-lm's qwen2_moe, as the model)."""
    config = _qwen_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        num_experts=meta.int(f"{a}.expert_count"),
        num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
        moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
        shared_expert_intermediate_size=meta.int(f"{a}.expert_shared_feed_forward_length"),
    )
    return config


def _experts_config(meta, shapes, spec) -> dict:
    """Mixtral (llama.cpp writes it as "llama" with experts), OLMoE, gpt-oss: every layer's FFN is experts (of
    expert_feed_forward_length, else feed_forward_length), top-k weights as the model's class does them
    (renormalised in Mixtral, not in OLMoE)."""
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    count = "num_local_experts" if spec.model_type in ("mixtral", "gpt_oss", "granitemoe") else "num_experts"
    config.update(
        {
            count: meta.int(f"{a}.expert_count"),
            "num_experts_per_tok": meta.int(f"{a}.expert_used_count"),
            "intermediate_size": meta.int(f"{a}.expert_feed_forward_length", meta.int(f"{a}.feed_forward_length", 0)),
        }
    )
    return config


def _gpt_oss_config(meta, shapes, spec) -> dict:
    """gpt-oss: experts with biases (MXFP4 in its GGUFs), attention sinks, sliding-window layers alternating with
    full ones (llama.cpp's pattern 2: even layers slide), YaRN."""
    config = _experts_config(meta, shapes, spec)
    n = config["num_hidden_layers"]
    config.update(
        sliding_window=meta.int(f"{meta['general.architecture']}.attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
    )
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
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": meta.int(f"{a}.embedding_length"),
        "num_hidden_layers": meta.int(f"{a}.block_count"),
        "num_attention_heads": meta.int(f"{a}.attention.head_count"),
        "num_key_value_heads": meta.int(f"{a}.attention.head_count"),  # (the GGUF's 1: MQA over the latent)
        "intermediate_size": meta.int(f"{a}.feed_forward_length"),
        "moe_intermediate_size": meta.int(f"{a}.expert_feed_forward_length"),
        "n_routed_experts": meta.int(f"{a}.expert_count"),
        "num_experts_per_tok": meta.int(f"{a}.expert_used_count"),
        "n_shared_experts": meta.int(f"{a}.expert_shared_count", 0) or None,
        "first_k_dense_replace": meta.int(f"{a}.leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "routed_scaling_factor": meta.float(f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", False)),
        "n_group": meta.int(f"{a}.expert_group_count", 1),
        "topk_group": meta.int(f"{a}.expert_group_used_count", 1),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "q_lora_rank": meta.int(f"{a}.attention.q_lora_rank", 0) or None,
        "kv_lora_rank": meta.int(f"{a}.attention.kv_lora_rank"),
        "qk_rope_head_dim": rope,
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


def _sigmoid_routing(meta, a: str) -> dict:
    """DeepSeek-V3-style routing as llama.cpp's glm4moe / dots1 / minimax-m2 store it (sigmoid scores, exp_probs_b
    choosing the experts, groups, a scale) under mlx-lm's names."""
    if meta.int(f"{a}.expert_gating_func", 2) != 2:  # (llama.cpp's glm4moe reads a missing one as sigmoid)
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with softmax routing is not supported")
    return {
        "num_experts_per_tok": meta.int(f"{a}.expert_used_count"),
        "moe_intermediate_size": meta.int(f"{a}.expert_feed_forward_length"),
        "n_routed_experts": meta.int(f"{a}.expert_count"),
        "n_shared_experts": meta.int(f"{a}.expert_shared_count", 0),
        "first_k_dense_replace": meta.int(f"{a}.leading_dense_block_count", 0),
        "routed_scaling_factor": meta.float(f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", False)),
        "n_group": meta.int(f"{a}.expert_group_count", 1),
        "topk_group": meta.int(f"{a}.expert_group_used_count", 1),
    }


def _glm4_moe_config(meta, shapes, spec) -> dict:
    """GLM-4.5 (llama.cpp "glm4moe"): q/k/v biases, optional q/k norms, half-rotary heads, leading dense layers,
    sigmoid routing with shared experts; its MTP block (nextn) left out."""
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        _sigmoid_routing(meta, a),
        rope_scaling=config.get("rope_scaling"),
        use_qk_norm="blk.0.attn_q_norm.weight" in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        partial_rotary_factor=config.get("partial_rotary_factor", 1.0),
    )
    return config


def _dots1_config(meta, shapes, spec) -> dict:
    """dots.llm1 (llama.cpp "dots1"): Qwen3's attention, DeepSeek-V3's routing and shared experts."""
    config = _base_config(meta, shapes, spec)
    config.update(_sigmoid_routing(meta, meta["general.architecture"]), scoring_func="noaux_tc")
    return config


def _minimax_m2_config(meta, shapes, spec) -> dict:
    """MiniMax-M2 (llama.cpp "minimax-m2" -> mlx-lm's minimax): q/k norms over all heads, a rotary part of each head,
    sigmoid routing with exp_probs_b, no shared expert."""
    config = _base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    routing = _sigmoid_routing(meta, a)
    if routing["n_shared_experts"] or routing["first_k_dense_replace"] or routing["routed_scaling_factor"] != 1.0:
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with shared experts, dense layers or a routing scale")
    config.update(
        intermediate_size=routing["moe_intermediate_size"],
        num_local_experts=routing["n_routed_experts"],
        num_experts_per_tok=routing["num_experts_per_tok"],
        shared_intermediate_size=0,
        scoring_func="sigmoid",
        use_qk_norm="blk.0.attn_q_norm.weight" in shapes,
    )
    return config


def _granitemoe_config(meta, shapes, spec) -> dict:
    """Granite MoE (llama.cpp "granitemoe"): Mixtral's blocks with Granite's four multipliers."""
    config = _experts_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        logits_scaling=meta.float(f"{a}.logit_scale", 1.0),
        attention_multiplier=meta.float(f"{a}.attention.scale", 1.0 / config["hidden_size"] ** 0.5),
        embedding_multiplier=meta.float(f"{a}.embedding_scale", 1.0),
        residual_multiplier=meta.float(f"{a}.residual_scale", 1.0),
        attention_bias="blk.0.attn_q.bias" in shapes,
    )
    return config


def _ernie_moe_config(meta, shapes, spec) -> dict:
    """ERNIE 4.5 MoE (llama.cpp "ernie4_5-moe"): leading dense layers, then an MoE layer every
    interleave_moe_layer_step, softmax routing renormalised over the top k, shared experts. A correction bias
    (exp_probs_b) is refused: llama.cpp picks the experts with it, mlx-lm's ernie4_5_moe drops it (its sanitize)."""
    a = meta["general.architecture"]
    if any(k.endswith(".exp_probs_b.bias") for k in shapes):
        raise UnsupportedArchitectureError(
            f"{meta.path}: {a} with exp_probs_b (llama.cpp chooses experts with it, mlx-lm's ernie4_5_moe drops it)"
        )
    config = _base_config(meta, shapes, spec)
    moe_ff, shared = meta.int(f"{a}.expert_feed_forward_length"), meta.int(f"{a}.expert_shared_count", 0)
    widths = {v[0] for k, v in shapes.items() if k.endswith(".ffn_up_shexp.weight")}
    if widths - {moe_ff * shared}:  # (mlx-lm's shared experts are moe_intermediate_size wide each)
        raise UnsupportedArchitectureError(f"{meta.path}: {a} shared experts {widths} wide, not {moe_ff} x {shared}")
    config.update(
        moe_num_experts=meta.int(f"{a}.expert_count"),
        moe_k=meta.int(f"{a}.expert_used_count"),
        moe_layer_start_index=meta.int(f"{a}.leading_dense_block_count", 0),
        moe_layer_interval=meta.int(f"{a}.interleave_moe_layer_step"),
        moe_intermediate_size=moe_ff,
        moe_num_shared_experts=shared,
        use_bias=False,
    )
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
    # the config key taking a rotary part of each head (rope.dimension_count < head_dim): a fraction, or "rotary_dim"
    partial_rotary: Optional[str] = None
    # metadata key (after "<arch>.") counting the multi-token-prediction blocks llama.cpp appends after the model's
    # own: mlx-lm's models run without them (their sanitize drops them), so their tensors are left out
    mtp_key: Optional[str] = None
    layers: str = "model.layers"  # the mlx-lm path of the blocks


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

_EXPERTS = {
    "ffn_gate_exps": "switch_mlp.gate_proj",
    "ffn_up_exps": "switch_mlp.up_proj",
    "ffn_down_exps": "switch_mlp.down_proj",
}
# DeepSeek-V3-style MoE layers: a router with a correction bias choosing the experts, shared experts
_SIGMOID_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# llama.cpp's "llama" with expert_count (and stacked ffn_*_exps: GGUFs from before mid-2024 hold an
# ffn_gate.E tensor per expert, refused as unmapped)
_MIXTRAL = ArchSpec(
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    block_names={
        **_ATTENTION,
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "block_sparse_moe.gate",
        **{k: f"block_sparse_moe.{v}" for k, v in _EXPERTS.items()},
    },
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
        block_names={
            **_ATTENTION,
            **_QK_NORM,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.gate",
            **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
        },
        make_config=_qwen3_moe_config,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rejected=_ROPE_FREQS,
        experts=True,
    ),
    "qwen2moe": ArchSpec(
        model_type="qwen2_moe",
        hf_class="Qwen2MoeForCausalLM",
        block_names={
            **_ATTENTION,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.gate",
            **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj",
        },
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
        block_names={
            **_ATTENTION,
            **_QK_NORM,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.gate",
            **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
        },
        make_config=_experts_config,
        rejected=_ROPE_FREQS,
        experts=True,
    ),
    "gpt-oss": ArchSpec(  # (NeoX RoPE: stored unpermuted)
        model_type="gpt_oss",
        hf_class="GptOssForCausalLM",
        block_names={
            **_ATTENTION,
            "attn_sinks": "self_attn.sinks",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.router",
            **{k: v.replace("switch_mlp", "mlp.experts") for k, v in _EXPERTS.items()},
        },
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
    "glm4moe": ArchSpec(  # (NeoX RoPE: stored unpermuted)
        model_type="glm4_moe",
        hf_class="Glm4MoeForCausalLM",
        block_names={
            **_ATTENTION,
            **_QK_NORM,
            "post_attention_norm": "post_attention_layernorm",
            **{k: v for k, v in _SWIGLU.items() if k != "ffn_norm"},  # the leading dense layers
            **_SIGMOID_EXPERTS,
        },
        make_config=_glm4_moe_config,
        experts=True,
        bare=("exp_probs_b",),
        partial_rotary="partial_rotary_factor",
        mtp_key="nextn_predict_layers",
    ),
    "dots1": ArchSpec(  # (NeoX RoPE: stored unpermuted)
        model_type="dots1",
        hf_class="Dots1ForCausalLM",
        block_names={
            **_ATTENTION,
            **_QK_NORM,
            **_SWIGLU,
            **{k: v.replace("switch_mlp", "experts") for k, v in _SIGMOID_EXPERTS.items()},
        },
        make_config=_dots1_config,
        rms_norm_eps=1e-6,
        experts=True,
        bare=("exp_probs_b",),
    ),
    "minimax-m2": ArchSpec(  # (NeoX RoPE: stored unpermuted)
        model_type="minimax",
        hf_class="MiniMaxM2ForCausalLM",
        block_names={
            **_ATTENTION,
            **_QK_NORM,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "block_sparse_moe.gate",
            "exp_probs_b": "block_sparse_moe.e_score_correction_bias",
            **{k: f"block_sparse_moe.{v}" for k, v in _EXPERTS.items()},
        },
        make_config=_minimax_m2_config,
        rms_norm_eps=1e-6,
        experts=True,
        bare=("exp_probs_b",),
        partial_rotary="rotary_dim",
    ),
    "granitemoe": ArchSpec(
        model_type="granitemoe",
        hf_class="GraniteMoeForCausalLM",
        block_names={
            **_ATTENTION,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "block_sparse_moe.router.layer",
            **{k: f"block_sparse_moe.{v}" for k, v in _EXPERTS.items()},
        },
        make_config=_granitemoe_config,
        permuted=_LLAMA.permuted,
        head_dim_key=False,
        experts=True,
    ),
    "ernie4_5-moe": ArchSpec(  # (RoPE on adjacent pairs, as mlx-lm's traditional=True: stored unpermuted)
        model_type="ernie4_5_moe",
        hf_class="Ernie4_5_MoeForCausalLM",
        block_names={
            **_ATTENTION,
            **_SWIGLU,
            "ffn_gate_inp": "mlp.gate",
            **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
            **{k: v for k, v in _SIGMOID_EXPERTS.items() if k.endswith("_shexp")},
            "exp_probs_b": "mlp.gate.e_score_correction_bias",  # (refused by _ernie_moe_config, saying why)
        },
        make_config=_ernie_moe_config,
        head_dim_key=False,
        experts=True,
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


# llama.cpp architectures with an mlx-lm class of their own that mlx_flash does not convert, and why
NOT_CONVERTED = {
    "qwen3next": "its gated DeltaNet layers (ssm_* tensors, as llama.cpp's converter rearranges them) are not mapped",
    "qwen35moe": "its gated DeltaNet layers (ssm_* tensors, as llama.cpp's converter rearranges them) are not mapped",
    "llama4": "llama4 GGUFs are not mapped yet (mlx-lm's llama4 wrapper, its chunked attention and no-RoPE layers)",
    "hunyuan-moe": "llama.cpp renormalises the top-k expert weights and mlx-lm's hunyuan does not",
    "deepseek32": "the lightning indexer (indexer.* tensors) is not mapped onto mlx-lm's deepseek_v32",
}


def arch_spec(arch: Optional[str], meta: "Meta") -> ArchSpec:
    path = meta.path
    if arch in NOT_CONVERTED:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported: {NOT_CONVERTED[arch]}"
        )
    spec = _MIXTRAL if arch == "llama" and meta.get("llama.expert_count", 0) else ARCHITECTURES.get(arch)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return spec


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def map_name(spec: ArchSpec, base: str) -> Tuple[Optional[str], Optional[str]]:
    """GGUF base name -> (mlx-lm module path, permutation head-count key or None). (None, None) if unknown."""
    if base in spec.global_names:
        return spec.global_names[base], None
    m = _BLOCK_RE.match(base)
    if m and m.group(2) in spec.block_names:
        return f"{spec.layers}.{m.group(1)}.{spec.block_names[m.group(2)]}", spec.permuted.get(m.group(2))
    return None, None


def mtp_blocks(spec: ArchSpec, meta: "Meta") -> int:
    return meta.int(f"{meta['general.architecture']}.{spec.mtp_key}", 0) if spec.mtp_key else 0


def is_mtp(spec: ArchSpec, meta: "Meta", base: str) -> bool:
    """A tensor of the multi-token-prediction blocks (ArchSpec.mtp_key), left out of the converted model."""
    m = _BLOCK_RE.match(base)
    n = mtp_blocks(spec, meta)
    return bool(n and m) and int(m.group(1)) >= meta.int(f"{meta['general.architecture']}.block_count") - n


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
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int):
            raise SourceError(f"{self.path}: GGUF metadata {key} is {str(v)[:40]!r}, not an integer")
        return v

    def float(self, key, default=None) -> float:
        v = self._required(key) if default is None else self.get(key, default)
        if not isinstance(v, (int, float)):
            raise SourceError(f"{self.path}: GGUF metadata {key} is {str(v)[:40]!r}, not a number")
        return float(f"{v:.7g}")  # GGUF floats are float32: 9.999999747e-06 -> 1e-05
