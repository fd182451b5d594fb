"""GGUF architectures: how a GGUF's tensor names map onto an mlx-lm model, and which config builder
(gguf_config.py, with the metadata's typed getters) makes its config (see gguf.py for the reading and the
supported list)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from ..errors import UnsupportedArchitectureError
from .gguf_config import (
    Meta,  # (imported from here by the tokenizer and tests)
    deepseek2_config,
    deepseek32_config,
    dots1_config,
    ernie_moe_config,
    experts_config,
    gemma3_config,
    glm4_moe_config,
    gpt_oss_config,
    granitemoe_config,
    hunyuan_moe_config,
    llama4_config,
    llama_config,
    minimax_m2_config,
    mtp_blocks,
    phi3_config,
    qwen2_moe_config,
    qwen3_moe_config,
    qwen3next_config,
    qwen_config,
)
from .gguf_deltanet import DeltaNetRearranger


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
    # makes, for one file, what takes the GGUF's tensors in order and hands back those of mlx-lm's layout (tensors
    # llama.cpp's converter split, reordered or transformed: gguf_deltanet.py), with a finish() to call at the end
    rearranger: Optional[Callable[["Meta"], Callable]] = None


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
    make_config=llama_config,
    permuted={"attn_q": "attention.head_count", "attn_k": "attention.head_count_kv"},
    rejected=_ROPE_FREQS,
)

_EXPERTS = {
    "ffn_gate_exps": "switch_mlp.gate_proj",
    "ffn_up_exps": "switch_mlp.up_proj",
    "ffn_down_exps": "switch_mlp.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# DeepSeek-V3-style MoE layers: a router with a correction bias choosing the experts, shared experts
_SIGMOID_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
    **_SHARED_EXPERT,
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
    make_config=experts_config,
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
        make_config=qwen_config,
        head_dim_key=False,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rejected=_ROPE_FREQS,
    ),
    "qwen3": ArchSpec(
        model_type="qwen3",
        hf_class="Qwen3ForCausalLM",
        block_names={**_ATTENTION, **_QK_NORM, **_SWIGLU},
        make_config=qwen_config,
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
        make_config=qwen3_moe_config,
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
        make_config=qwen2_moe_config,
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
        make_config=experts_config,
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
        make_config=gpt_oss_config,
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
        make_config=deepseek2_config,
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
        make_config=glm4_moe_config,
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
        make_config=dots1_config,
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
        make_config=minimax_m2_config,
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
        make_config=granitemoe_config,
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
            **_SHARED_EXPERT,
            "exp_probs_b": "mlp.gate.e_score_correction_bias",  # (refused by ernie_moe_config, saying why)
        },
        make_config=ernie_moe_config,
        head_dim_key=False,
        experts=True,
    ),
    "llama4": ArchSpec(  # (RoPE on adjacent pairs, as mlx-lm's traditional=True: its converter does not permute)
        model_type="llama4",
        hf_class="Llama4ForConditionalGeneration",
        block_names={
            **_ATTENTION,
            **{k: v.replace("mlp.", "feed_forward.") for k, v in _SWIGLU.items()},  # (the dense layers)
            "ffn_gate_inp": "feed_forward.router",
            **{k: v.replace("switch_mlp", "feed_forward.experts") for k, v in _EXPERTS.items()},
            **{k: v.replace("mlp.shared_experts", "feed_forward.shared_expert") for k, v in _SHARED_EXPERT.items()},
        },
        make_config=llama4_config,
        rope_theta=500000.0,
        rejected=_ROPE_FREQS,
        experts=True,
        layers="language_model.model.layers",
        global_names={
            "token_embd": "language_model.model.embed_tokens",
            "output_norm": "language_model.model.norm",
            "output": "language_model.lm_head",
        },
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
        make_config=gemma3_config,
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
        make_config=phi3_config,
        head_dim_key=False,
        rejected={
            name: "Phi-3 long-context rope factors (rope_factors_long/short) are not supported yet"
            for name in ("rope_factors_long", "rope_factors_short")
        },
    ),
}

# Qwen3-Next / Qwen3.5 MoE: gated DeltaNet layers (gguf_deltanet.py) and full-attention ones, experts and a shared
# expert in every layer
_DELTANET = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    **{k: v for k, v in _ATTENTION.items() if k != "attn_norm"},
    **_QK_NORM,
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate",
    **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    **{k: v.replace("shared_experts", "shared_expert") for k, v in _SHARED_EXPERT.items()},
}
ARCHITECTURES["qwen3next"] = ArchSpec(  # (NeoX RoPE: stored unpermuted)
    model_type="qwen3_next",
    hf_class="Qwen3NextForCausalLM",
    block_names={
        **_DELTANET,
        # attn_qkv and attn_gate are joined into in_proj_qkvz, written as ssm_in (older GGUFs' name for it)
        **dict.fromkeys(("attn_qkv", "attn_gate", "ssm_in"), "linear_attn.in_proj_qkvz"),
        "ssm_ba": "linear_attn.in_proj_ba",
    },
    make_config=qwen3next_config,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    experts=True,
    row_vectors=("ffn_gate_inp_shexp",),
    bare=("ssm_a", "ssm_dt"),
    partial_rotary="partial_rotary_factor",
    mtp_key="nextn_predict_layers",
    rearranger=lambda meta: DeltaNetRearranger(meta, tiled=False),
)
ARCHITECTURES["qwen35moe"] = dataclasses.replace(
    ARCHITECTURES["qwen3next"],
    model_type="qwen3_5_moe",
    hf_class="Qwen3_5MoeForConditionalGeneration",
    block_names={
        **_DELTANET,
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_alpha": "linear_attn.in_proj_a",
    },
    layers="language_model.model.layers",
    global_names={k: f"language_model.{v}" for k, v in _LLAMA.global_names.items()},
    rearranger=lambda meta: DeltaNetRearranger(meta, tiled=True),
)

ARCHITECTURES["hunyuan-moe"] = ArchSpec(  # (NeoX RoPE: stored unpermuted)
    model_type="hunyuan_moe",  # (mlx_flash.models.hunyuan_moe: mlx-lm's hunyuan with the top-k renormalised)
    hf_class="HunYuanMoEV1ForCausalLM",
    block_names={
        **_ATTENTION,
        "attn_q_norm": "self_attn.query_layernorm",
        "attn_k_norm": "self_attn.key_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate.wg",
        **{k: f"mlp.{v}" for k, v in _EXPERTS.items()},
        **{k: v.replace("shared_experts", "shared_mlp") for k, v in _SHARED_EXPERT.items()},
    },
    make_config=hunyuan_moe_config,
    head_dim_key=False,
    experts=True,
    rejected={
        **_ROPE_FREQS,
        "output": "hunyuan-moe with an output.weight of its own is not supported (mlx-lm's hunyuan ties its head "
        "to the embedding)",
    },
)

ARCHITECTURES["deepseek32"] = dataclasses.replace(
    ARCHITECTURES["deepseek2"],
    model_type="deepseek_v32",
    hf_class="DeepseekV32ForCausalLM",
    block_names={
        **ARCHITECTURES["deepseek2"].block_names,
        "indexer.k_norm": "self_attn.indexer.k_norm",
        "indexer.proj": "self_attn.indexer.weights_proj",
        "indexer.attn_k": "self_attn.indexer.wk",
        "indexer.attn_q_b": "self_attn.indexer.wq_b",
    },
    make_config=deepseek32_config,
    mtp_key="nextn_predict_layers",
)


# llama.cpp architectures with an mlx-lm class of their own that mlx_flash does not convert, and why
NOT_CONVERTED = {}


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


def is_mtp(spec: ArchSpec, meta: "Meta", base: str) -> bool:
    """A tensor of the multi-token-prediction blocks (ArchSpec.mtp_key), left out of the converted model."""
    m = _BLOCK_RE.match(base)
    n = mtp_blocks(spec, meta)
    return bool(n and m) and int(m.group(1)) >= meta.int(f"{meta['general.architecture']}.block_count") - n
