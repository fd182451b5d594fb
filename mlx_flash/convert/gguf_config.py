"""GGUF metadata (Meta: the key/value pairs with typed getters) and, for each architecture, the builder of the mlx-lm
config.json it maps onto (gguf_archs.py has the tensor names)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import SourceError, UnsupportedArchitectureError


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


def rope_scaling(meta: "Meta", a: str, spec) -> Optional[dict]:
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


def base_config(meta: "Meta", shapes: Dict[str, Tuple[int, ...]], spec) -> dict:
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
    scaling = rope_scaling(meta, a, spec)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def llama_config(meta, shapes, spec) -> dict:
    config = base_config(meta, shapes, spec)
    config.update(
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in shapes,
        mlp_bias="blk.0.ffn_up.bias" in shapes,
    )
    return config


def qwen_config(meta, shapes, spec) -> dict:
    config = base_config(meta, shapes, spec)
    config["hidden_act"] = "silu"
    if (
        spec.model_type in ("qwen2", "qwen2_moe") and "blk.0.attn_q.bias" not in shapes
    ):  # mlx-lm's always has q/k/v biases
        raise UnsupportedArchitectureError(
            f"{meta.path}: {meta['general.architecture']} GGUF without attn_q/attn_k/attn_v biases"
        )
    return config


def qwen3_moe_config(meta, shapes, spec) -> dict:
    """Qwen3-MoE (llama.cpp "qwen3moe"): every layer's FFN is experts, top-k weights renormalised."""
    config = base_config(meta, shapes, spec)
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


def qwen2_moe_config(meta, shapes, spec) -> dict:
    """Qwen1.5/2-MoE (llama.cpp "qwen2moe"): experts plus a shared expert behind a sigmoid gate; top-k weights not
    renormalised (mlx-lm's qwen2_moe, as the model)."""
    config = qwen_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        num_experts=meta.int(f"{a}.expert_count"),
        num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
        moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
        shared_expert_intermediate_size=meta.int(f"{a}.expert_shared_feed_forward_length"),
    )
    return config


def experts_config(meta, shapes, spec) -> dict:
    """Mixtral (llama.cpp writes it as "llama" with experts), OLMoE, gpt-oss: every layer's FFN is experts (of
    expert_feed_forward_length, else feed_forward_length), top-k weights as the model's class does them
    (renormalised in Mixtral, not in OLMoE)."""
    config = base_config(meta, shapes, spec)
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


def gpt_oss_config(meta, shapes, spec) -> dict:
    """gpt-oss: experts with biases (MXFP4 in its GGUFs), attention sinks, sliding-window layers alternating with
    full ones (llama.cpp's pattern 2: even layers slide), YaRN."""
    config = experts_config(meta, shapes, spec)
    n = config["num_hidden_layers"]
    config.update(
        sliding_window=meta.int(f"{meta['general.architecture']}.attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
    )
    return config


def deepseek2_config(meta, shapes, spec) -> dict:
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
    scaling = rope_scaling(meta, a, spec)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def sigmoid_routing(meta, a: str) -> dict:
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


def glm4_moe_config(meta, shapes, spec) -> dict:
    """GLM-4.5 (llama.cpp "glm4moe"): q/k/v biases, optional q/k norms, half-rotary heads, leading dense layers,
    sigmoid routing with shared experts; its MTP block (nextn) left out."""
    config = base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        sigmoid_routing(meta, a),
        rope_scaling=config.get("rope_scaling"),
        use_qk_norm="blk.0.attn_q_norm.weight" in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        partial_rotary_factor=config.get("partial_rotary_factor", 1.0),
    )
    return config


def dots1_config(meta, shapes, spec) -> dict:
    """dots.llm1 (llama.cpp "dots1"): Qwen3's attention, DeepSeek-V3's routing and shared experts."""
    config = base_config(meta, shapes, spec)
    config.update(sigmoid_routing(meta, meta["general.architecture"]), scoring_func="noaux_tc")
    return config


def minimax_m2_config(meta, shapes, spec) -> dict:
    """MiniMax-M2 (llama.cpp "minimax-m2" -> mlx-lm's minimax): q/k norms over all heads, a rotary part of each head,
    sigmoid routing with exp_probs_b, no shared expert."""
    config = base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    routing = sigmoid_routing(meta, a)
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


def granitemoe_config(meta, shapes, spec) -> dict:
    """Granite MoE (llama.cpp "granitemoe"): Mixtral's blocks with Granite's four multipliers."""
    config = experts_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        logits_scaling=meta.float(f"{a}.logit_scale", 1.0),
        attention_multiplier=meta.float(f"{a}.attention.scale", 1.0 / config["hidden_size"] ** 0.5),
        embedding_multiplier=meta.float(f"{a}.embedding_scale", 1.0),
        residual_multiplier=meta.float(f"{a}.residual_scale", 1.0),
        attention_bias="blk.0.attn_q.bias" in shapes,
    )
    return config


def ernie_moe_config(meta, shapes, spec) -> dict:
    """ERNIE 4.5 MoE (llama.cpp "ernie4_5-moe"): leading dense layers, then an MoE layer every
    interleave_moe_layer_step, softmax routing renormalised over the top k, shared experts. A correction bias
    (exp_probs_b) is refused: llama.cpp picks the experts with it, mlx-lm's ernie4_5_moe drops it (its sanitize)."""
    a = meta["general.architecture"]
    if any(k.endswith(".exp_probs_b.bias") for k in shapes):
        raise UnsupportedArchitectureError(
            f"{meta.path}: {a} with exp_probs_b (llama.cpp chooses experts with it, mlx-lm's ernie4_5_moe drops it)"
        )
    config = base_config(meta, shapes, spec)
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


def phi3_config(meta, shapes, spec) -> dict:
    config = base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config["original_max_position_embeddings"] = meta.int(
        f"{a}.rope.scaling.original_context_length", config["max_position_embeddings"]
    )
    return config


def gemma3_config(meta, shapes, spec) -> dict:
    """Gemma 3. What the GGUF leaves out comes from llama.cpp's llama_load_hparams_gemma3: every 6th
    layer global (sliding window pattern 6), local RoPE base 10000, and the attention scale
    1/sqrt(head_dim), except the 62-layer 27B's 1/sqrt(hidden / heads)."""
    a = meta["general.architecture"]
    config = base_config(meta, shapes, spec)
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


def mtp_blocks(spec, meta: "Meta") -> int:
    """How many multi-token-prediction blocks (ArchSpec.mtp_key) follow the model's own."""
    return meta.int(f"{meta['general.architecture']}.{spec.mtp_key}", 0) if spec.mtp_key else 0


def llama4_config(meta, shapes, spec) -> dict:
    """Llama 4 (llama.cpp "llama4" -> mlx-lm's llama4, its text_config): an MoE layer every interleave_moe_layer_step
    (a top-1 sigmoid router, a shared expert as wide as an expert), dense layers between. The rest is fixed in
    llama.cpp, not in the GGUF: attention chunked by 8192 in three layers of four, the fourth without RoPE and with
    temperature tuning, q/k L2-normed in the RoPE layers except in the 128-expert model."""
    a = meta["general.architecture"]
    if meta.int(f"{a}.attention.sliding_window", 8192) != 8192:  # (0: MobileLLM, every layer full and with RoPE)
        raise UnsupportedArchitectureError(f"{meta.path}: {a} without 8192-token chunked attention is not supported")
    text = base_config(meta, shapes, spec)
    config = {k: text.pop(k) for k in ("architectures", "model_type", "tie_word_embeddings")}
    experts = meta.int(f"{a}.expert_count")
    text.update(
        model_type="llama4_text",
        attention_bias=False,
        attention_chunk_size=8192,
        interleave_moe_layer_step=meta.int(f"{a}.interleave_moe_layer_step"),
        intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
        intermediate_size_mlp=meta.int(f"{a}.feed_forward_length"),
        num_local_experts=experts,
        num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
        use_qk_norm=experts != 128,
        rope_scaling=text.get("rope_scaling"),
    )
    return {**config, "text_config": text}


def _attention_interval(meta, a: str, n_layers: int) -> int:
    """Every how many layers one has full attention (the rest gated DeltaNet), as mlx-lm's qwen3_next / qwen3_5 take
    it: from attention.recurrent_layers when the GGUF has it (llama.cpp's converter writes the model's layer_types),
    else full_attention_interval (llama.cpp's default 4)."""
    interval = meta.int(f"{a}.full_attention_interval", 4)
    recurrent = meta.get(f"{a}.attention.recurrent_layers")
    if isinstance(recurrent, list):
        full = [i for i, r in enumerate(recurrent[:n_layers]) if not r]
        interval = full[0] + 1 if full else n_layers + 1
        if [not r for r in recurrent[:n_layers]] != [(i + 1) % interval == 0 for i in range(n_layers)]:
            raise UnsupportedArchitectureError(
                f"{meta.path}: {a} with full-attention layers {full} (mlx-lm's takes one every N layers)"
            )
    return interval


def qwen3next_config(meta, shapes, spec) -> dict:
    """Qwen3-Next (llama.cpp "qwen3next") and Qwen3.5 MoE's text model ("qwen35moe"): gated DeltaNet layers (the
    ssm.* keys) with a full-attention layer every full_attention_interval (its query doubled as an output gate, a
    rotary part of each head), every FFN experts (top-k renormalised, as llama.cpp routes them) plus a shared expert
    behind a sigmoid gate; its MTP block (nextn) left out."""
    config = base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    n_v = meta.int(f"{a}.ssm.time_step_rank")
    config.update(
        hidden_act="silu",
        linear_num_value_heads=n_v,
        linear_num_key_heads=meta.int(f"{a}.ssm.group_count"),
        linear_key_head_dim=meta.int(f"{a}.ssm.state_size"),
        linear_value_head_dim=meta.int(f"{a}.ssm.inner_size") // max(n_v, 1),
        linear_conv_kernel_dim=meta.int(f"{a}.ssm.conv_kernel"),
        full_attention_interval=_attention_interval(meta, a, config["num_hidden_layers"]),
        num_experts=meta.int(f"{a}.expert_count"),
        num_experts_per_tok=meta.int(f"{a}.expert_used_count"),
        moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length"),
        shared_expert_intermediate_size=meta.int(f"{a}.expert_shared_feed_forward_length", config["intermediate_size"]),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        attention_bias=False,
    )
    if spec.model_type == "qwen3_next":
        return config
    # Qwen3.5: mlx-lm's qwen3_5_moe, the text model under text_config, RoPE from rope_parameters (its multimodal
    # sections all take the one text position: plain RoPE)
    top = {k: config.pop(k) for k in ("architectures", "model_type", "tie_word_embeddings")}
    sections = meta.get(f"{a}.rope.dimension_sections", [11, 11, 10, 0])[:3]
    config.update(
        model_type="qwen3_5_moe_text",
        rope_parameters={
            "type": "default",
            "rope_theta": config.pop("rope_theta"),
            "partial_rotary_factor": config.pop("partial_rotary_factor"),
            "mrope_section": list(sections),
        },
        tie_word_embeddings=top["tie_word_embeddings"],
    )
    return {**top, "text_config": config}


def hunyuan_moe_config(meta, shapes, spec) -> dict:
    """Hunyuan-A13B (llama.cpp "hunyuan-moe") -> mlx_flash's hunyuan_moe (mlx-lm's hunyuan, the top-k weights
    renormalised as llama.cpp and the reference route): q/k norms after RoPE, every FFN experts plus an ungated shared
    MLP, the head tied to the embedding. llama.cpp's converter folds the NTK alpha into rope.freq_base, so the alpha
    here is 1."""
    config = base_config(meta, shapes, spec)
    a = meta["general.architecture"]
    if meta.float(f"{a}.expert_weights_scale", 1.0) not in (0.0, 1.0):  # (llama.cpp reads 0 as none)
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with an expert weights scale is not supported")
    shared = meta.int(f"{a}.expert_shared_count", 1)
    width = meta.int(f"{a}.expert_shared_feed_forward_length", config["intermediate_size"])
    if shared < 1 or width % shared:
        raise UnsupportedArchitectureError(f"{meta.path}: {a} with {shared} shared experts {width} wide")
    config.update(
        num_experts=meta.int(f"{a}.expert_count"),
        moe_topk=meta.int(f"{a}.expert_used_count"),
        moe_intermediate_size=meta.int(f"{a}.expert_feed_forward_length", config["intermediate_size"]),
        intermediate_size=width // shared,  # (mlx-lm's shared MLP is intermediate_size x num_shared_expert wide)
        num_shared_expert=shared,
        use_mixed_mlp_moe="blk.0.ffn_up_shexp.weight" in shapes,
        use_qk_norm=True,
        use_cla=False,
        cla_share_factor=2,
        attention_bias="blk.0.attn_q.bias" in shapes,
        rope_scaling={"type": "dynamic", "alpha": 1.0, "factor": 1.0},
    )
    return config


def deepseek32_config(meta, shapes, spec) -> dict:
    """DeepSeek-V3.2 (llama.cpp "deepseek32" -> mlx-lm's deepseek_v32): deepseek2's MLA and routing, plus the
    lightning indexer choosing attention.indexer.top_k keys per query (its RoPE NeoX-style, fixed in llama.cpp); the
    MTP block (nextn) left out."""
    config = deepseek2_config(meta, shapes, spec)
    a = meta["general.architecture"]
    config.update(
        num_hidden_layers=config["num_hidden_layers"] - mtp_blocks(spec, meta),
        index_n_heads=meta.int(f"{a}.attention.indexer.head_count"),
        index_head_dim=meta.int(f"{a}.attention.indexer.key_length"),
        index_topk=meta.int(f"{a}.attention.indexer.top_k"),
        indexer_rope_interleave=False,
    )
    return config
