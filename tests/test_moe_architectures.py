"""Every mixture-of-experts architecture of mlx-lm (its experts a SwitchGLU or SwitchMLP): a tiny random 4-bit model
written with mlx-lm's own classes from a config named as the published ones (nested `text_config` for multimodal
wrappers), converted, then streamed at no budget, 25% and 50% of the experts and below the resident floor (attention,
embeddings and head streamed too): greedy tokens equal mlx-lm's on the same directory, logits within 1e-4 (exact mode:
float32 activations). Architectures that cannot stream are refused at convert with one line saying why."""

import json

import mlx_flash  # noqa: F401
from mlx_flash.budget import fixed_bytes, min_budget, min_streaming_budget, with_streamed
from mlx_flash.compute import cpu_gemv
from mlx_flash.convert.build import convert
from mlx_flash.convert.source import load_source_model
from mlx_flash.engine.experts import REGION, experts_per_token, switch_paths
from mlx_flash.engine.resident import stream_groups
from mlx_flash.errors import UnsupportedArchitectureError
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import cpu_cast, kv_size_of, load
from mlx_flash.models.inspect import instantiate
from mlx_flash.models.tiny import make_tiny_model_dir, make_tiny_quantized_dir

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step

PROMPT = mx.array([1, 5, 9, 33, 70, 2, 11])
CONTEXT = 64

# hidden 64, 2-4 layers (a dense first layer where the architecture has one), 8 experts of width 32, 2 per token (3
# where the config names it otherwise: moe_k, moe_top_k, top_k_experts, num_experts_per_token, moe_topk; llama4 1); a
# vocabulary large enough that streaming the embedding and head saves more than its buffers (budgets below the floor;
# twice that where the head is the embedding, always tied: TIED)
VOCAB = 65536
# fmt: off
C = dict(hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=256,
         tie_word_embeddings=False)
KV = dict(num_key_value_heads=2, head_dim=16)
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
E = dict(moe_intermediate_size=32, num_experts_per_tok=2)
TIED = dict(vocab_size=2 * VOCAB)

ARCHS = {  # streamed: mlx-lm runs the model on the CPU, its experts a SwitchGLU / SwitchMLP
    "qwen3_moe": dict(C, **KV, **E, num_hidden_layers=2, intermediate_size=128, num_experts=8, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen2_moe": dict(C, **KV, **E, num_hidden_layers=2, intermediate_size=128, num_experts=8,
        shared_expert_intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6),
    "mixtral": dict(C, **KV, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1e6),
    "olmoe": dict(C, **E, num_hidden_layers=2, intermediate_size=32, num_experts=8, num_key_value_heads=4,
        rms_norm_eps=1e-5, rope_theta=10000.0),
    "deepseek": dict(C, **E, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
        first_k_dense_replace=1, moe_layer_freq=1, num_key_value_heads=4, rms_norm_eps=1e-6),
    "deepseek_v2": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", routed_scaling_factor=1.0,
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, num_key_value_heads=4, rms_norm_eps=1e-6),
    "deepseek_v3": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        num_key_value_heads=4, rms_norm_eps=1e-6),
    "deepseek_v32": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, index_head_dim=16, index_n_heads=2, index_topk=16, num_key_value_heads=4,
        rms_norm_eps=1e-6),
    "glm4_moe": dict(C, **KV, **E, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, use_qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=4, num_nextn_predict_layers=0),
    "gpt_oss": dict(C, **KV, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, rms_norm_eps=1e-5, rope_theta=150000, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_next": dict(C, **KV, **E, num_hidden_layers=2, intermediate_size=128, num_experts=8, decoder_sparse_step=1,
        mlp_only_layers=[], shared_expert_intermediate_size=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        partial_rotary_factor=0.25, rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True),
    "minimax": dict(C, **KV, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        shared_intermediate_size=0, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=8),
    "phimoe": dict(C, num_hidden_layers=2, intermediate_size=32, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, original_max_position_embeddings=256, rms_norm_eps=1e-5),
    "granitemoe": dict(C, num_hidden_layers=2, intermediate_size=64, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, rms_norm_eps=1e-6, logits_scaling=4.0, attention_multiplier=0.0625,
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_bias=False, rope_theta=10000.0),
    "bailing_moe": dict(C, **E, num_hidden_layers=3, intermediate_size=96, num_experts=8, num_shared_experts=1,
        norm_topk_prob=True, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, first_k_dense_replace=1,
        use_qk_norm=True),
    "dots1": dict(C, **KV, **E, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=10000.0,
        routed_scaling_factor=2.5, scoring_func="noaux_tc"),
    "exaone_moe": dict(C, **KV, **E, num_hidden_layers=3, intermediate_size=96, num_experts=8, num_shared_experts=1,
        rms_norm_eps=1e-5, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        is_moe_layer=[False, True, True]),
    "lfm2_moe": dict(C, **TIED, **E, num_hidden_layers=3, intermediate_size=96, num_experts=8, num_key_value_heads=2,
        norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        layer_types=["conv", "full_attention", "conv"]),
    "mimo_v2_flash": dict(C, **E, num_hidden_layers=3, intermediate_size=96, hybrid_layer_pattern=[0, 1, 0],
        moe_layer_freq=[0, 1, 1], add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        sliding_window_size=8, num_key_value_heads=2, n_shared_experts=None, n_routed_experts=8,
        routed_scaling_factor=None, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1,
        topk_group=1, layernorm_epsilon=1e-5, rope_theta=1e6, swa_rope_theta=10000.0, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, head_dim=16, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16,
        partial_rotary_factor=1),
    "laguna": dict(C, **KV, **E, num_hidden_layers=3, intermediate_size=96, num_experts=8,
        shared_expert_intermediate_size=32, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"]),
    "mistral4": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.0, norm_topk_prob=True, rms_norm_eps=1e-6,
        topk_group=1, first_k_dense_replace=1, n_group=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                         "original_max_position_embeddings": 256, "llama_4_scaling_beta": 0.1, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "ernie4_5_moe": dict(C, **KV, num_hidden_layers=3, intermediate_size=96, rms_norm_eps=1e-5, rope_theta=500000.0,
        use_bias=False, moe_num_experts=8, moe_layer_start_index=1, moe_intermediate_size=32, moe_k=3,
        moe_layer_interval=1, moe_num_shared_experts=1),
    "step3p5": dict(C, num_hidden_layers=2, num_attention_groups=2, head_dim=16, intermediate_size=96,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], moe_num_experts=8, moe_top_k=3,
        moe_intermediate_size=32, share_expert_dim=32, moe_layers_enum="0,1"),
    "gemma4_text": dict(C, **KV, num_hidden_layers=2, intermediate_size=64, global_head_dim=32,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=0, hidden_size_per_layer_input=8, sliding_window=8,
        sliding_window_pattern=2, enable_moe_block=True, num_experts=8, top_k_experts=3, moe_intermediate_size=32,
        tie_word_embeddings=True),
    "kimi_linear": dict(C, **E, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-5, model_max_length=256, num_experts=8, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, num_experts_per_token=3,
        num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": 4, "head_dim": 16,
                            "short_conv_kernel_size": 4}),
    "hunyuan": dict(C, **TIED, num_hidden_layers=2, intermediate_size=32, num_key_value_heads=2, attention_bias=False,
        moe_topk=3, num_experts=8, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, rms_norm_eps=1e-5,
        rope_theta=10000.0, use_cla=False, cla_share_factor=2, moe_intermediate_size=32,
        rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}),
    # (as published: num_hidden_layers counts the sublayers, two a layer; mlx-lm builds num_layers)
    "longcat_flash": dict(C, num_layers=2, num_hidden_layers=4, attention_method="MLA", zero_expert_type="identity",
        ffn_hidden_size=96,
        moe_topk=3, expert_ffn_hidden_size=32, n_routed_experts=8, zero_expert_num=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
        rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_bias=False),
}

ARCHS.update({
    "Klear": dict(C, **E, num_hidden_layers=2, intermediate_size=96, attention_bias=False, mlp_only_layers=[],
        num_experts=8, decoder_sparse_step=1, n_shared_experts=1, rms_norm_eps=1e-6, num_key_value_heads=2,
        rope_theta=10000.0, norm_topk_prob=True),
    "afmoe": dict(C, **KV, **E, num_hidden_layers=3, intermediate_size=96, num_experts=8, num_shared_experts=1,
        num_dense_layers=1, n_group=1, topk_group=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "bailing_moe_linear": dict(C, **E, num_hidden_layers=3, intermediate_size=96, num_experts=8,
        num_shared_experts=1, norm_topk_prob=True, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        first_k_dense_replace=1, layer_group_size=2, group_norm_size=1, use_qk_norm=True),
    "bailing_hybrid": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, num_key_value_heads=4,
        num_experts=8, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=2,
        group_norm_size=1, rms_norm_eps=1e-6, rope_theta=10000.0, routed_scaling_factor=2.5, head_dim=16),
    "bailing_moe_v3": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, num_experts=8,
        num_shared_experts=1, moe_shared_expert_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, layer_group_size=2, head_dim=16),
    "deepseek_v41": dict(C, num_hidden_layers=2, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, o_groups=2,
        o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, sliding_window=8,
        index_n_heads=2, index_head_dim=16, index_topk=16, hc_mult=2, rms_norm_eps=1e-6),
    "granitemoehybrid": dict(C, num_hidden_layers=2, intermediate_size=64, num_key_value_heads=2,
        attention_bias=False, embedding_multiplier=6.0, attention_multiplier=0.0625, logits_scaling=4.0,
        residual_multiplier=0.5, layer_types=["mamba", "attention"], rms_norm_eps=1e-6, num_local_experts=8,
        num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True),
    "jamba": dict(C, num_hidden_layers=2, intermediate_size=64, num_key_value_heads=2, attn_layer_offset=1,
        attn_layer_period=2, expert_layer_offset=0, expert_layer_period=1, mamba_d_conv=4, mamba_d_state=16,
        mamba_expand=2, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6),
    "mellum": dict(C, **KV, **E, num_hidden_layers=2, intermediate_size=96, num_experts=8, rms_norm_eps=1e-6,
        norm_topk_prob=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                         "full_attention": {"rope_theta": 1e6, "rope_type": "default"}}),
    "nemotron_h": dict(C, intermediate_size=64, num_key_value_heads=2, attention_bias=False, mamba_num_heads=4,
        mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        num_hidden_layers=4, hybrid_override_pattern=["M", "E", "*", "E"],
        head_dim=16, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=8,
        n_shared_experts=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=1.0),
    "phixtral": dict(num_vocab=VOCAB, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8, num_experts_per_tok=2,
        num_local_experts=8),
    "llama4": dict(text_config=dict(attention_bias=False, attention_chunk_size=8, head_dim=16, hidden_size=64,
        interleave_moe_layer_step=1, intermediate_size=32, intermediate_size_mlp=96, max_position_embeddings=256,
        model_type="llama4_text", num_attention_heads=4, num_experts_per_tok=1, num_hidden_layers=4,
        num_key_value_heads=2, num_local_experts=8, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=500000.0,
        use_qk_norm=True, vocab_size=VOCAB)),
    "qwen3_5_moe": dict(text_config=dict(C, **KV, **E, model_type="qwen3_5_moe_text", num_hidden_layers=2,
        intermediate_size=128, num_experts=8, shared_expert_intermediate_size=64, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, rms_norm_eps=1e-6,
        rope_parameters={"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6,
                         "partial_rotary_factor": 0.5})),
    "kimi_k25": dict(text_config=dict(C, **E, **MLA, model_type="kimi_k2", num_hidden_layers=3, intermediate_size=96,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, num_key_value_heads=4)),
    "kimi_vl": dict(text_config=dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=4)),
    "qwen3_vl_moe": dict(text_config=dict(C, model_type="qwen3_vl_moe_text", **KV, **E, num_hidden_layers=2,
        intermediate_size=128, num_experts=8,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6)),
    "gemma4": dict(vocab_size=VOCAB, text_config=dict(C, **KV, num_hidden_layers=2, intermediate_size=64,
        global_head_dim=32, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=0, hidden_size_per_layer_input=8,
        sliding_window=8, sliding_window_pattern=2, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32)),
    "glm_moe_dsa": dict(C, **E, **MLA, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, index_head_dim=16, index_n_heads=2, index_topk=16, num_key_value_heads=4,
        rms_norm_eps=1e-6, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, attention_bias=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "solar_open": dict(C, **KV, **E, num_hidden_layers=3, intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=1.0),
    "minimax_m3_vl": dict(text_config=dict(C, **KV, num_hidden_layers=2, intermediate_size=32,
        dense_intermediate_size=96, shared_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-6, mlp_layer_types=["dense", "sparse"])),
    "kimi_k3": dict(text_config=dict(C, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
        num_experts_per_token=2, moe_intermediate_size=32, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": 4, "head_dim": 16,
                            "short_conv_kernel_size": 4})),
    "longcat_flash_ngram": dict(C, num_layers=2, num_hidden_layers=4, attention_method="MLA",
        zero_expert_type="identity",
        ffn_hidden_size=96, moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=8, zero_expert_num=2,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=1.0, rms_norm_eps=1e-5, rope_theta=10000.0, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, attention_bias=False, ngram_vocab_size_ratio=1, emb_neighbor_num=2, emb_split_num=2),
})

# arch -> (config, what the one-line refusal names)
REFUSED = {
    # experts as a list of MLPs, not a SwitchGLU
    "dbrx": (dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                  ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
                  attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}),
             r"its experts, transformer.blocks.0.ffn.experts, are not a SwitchGLU or SwitchMLP"),
    # a norm stored inside the expert block (and a Metal-only kernel: mlx-lm cannot run it on the CPU)
    "muse_spark": (dict(text_config=dict(C, **KV, num_hidden_layers=2, rms_norm_eps=1e-6, post_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0}, layer_rope_theta=[10000.0, 0], sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0, output_multiplier=1.0,
        num_local_experts=8, num_experts_per_tok=2, moe_hidden_size=32, moe_intermediate_size=32)), "post_expert_norm"),
}
# fmt: on


# mlx-lm's model itself moves its last logits by 1e-3 when its inputs move by 1e-6 (relative): compared through
# MLX's ops (the same arithmetic, bit for bit), as the native kernels' float rounding differs from MLX's
ROUNDING_SENSITIVE = {"deepseek_v41"}


def published(arch: str, config: dict) -> dict:
    return {"model_type": arch, **config}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    """(arch, the 4-bit mlx-lm directory, its flash directory): converted once per architecture."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = make_tiny_quantized_dir(published(arch, ARCHS[arch]), root / "src")
    return arch, src, convert(str(src), root / "flash", progress=False)


def greedy(model, generate=generate_step, n=8):
    return [int(t) for t, _ in generate(PROMPT, model, max_tokens=n)]


def budgets(fd, exact=False):
    """name -> memory budget: every expert cached; 2 and 4 of the 8 experts cached per layer (with the input
    embedding streamed by rows, as the planner does whenever some expert goes uncached), the first also with the
    read-ahead of the next layer's experts into them; below the resident floor (every streamable group streamed, no
    expert cached)."""
    resident = fd.resident_nbytes(cpu_cast)
    groups = stream_groups(fd, instantiate(fd.config), cpu_cast, CONTEXT)
    rows = [g for g in groups if g.kind == "rows" and g.nbytes > 2 * g.load_bytes]
    base = sum(with_streamed(fixed_bytes(fd, CONTEXT, kv_size_of(fd, exact=exact), resident=resident), rows).values())
    per_slot = len(fd.layers) * fd.layouts[REGION].stride  # (the plan splits what is left evenly over the layers)
    lowest = min_streaming_budget(fd, CONTEXT, kv_size_of(fd, exact=exact), resident=resident, groups=groups)
    assert lowest < min_budget(fd, CONTEXT, kv_size_of(fd, exact=exact), resident=resident)
    return {
        "all": None,
        "25%": base + 2 * per_slot,
        "25% read ahead": base + 2 * per_slot,
        "50%": base + 4 * per_slot,
        "below floor": lowest,
    }


def test_streams_as_mlx_lm(converted, float_activations, monkeypatch):
    arch, src_dir, flash_dir = converted
    if arch in ROUNDING_SENSITIVE:
        monkeypatch.setattr(cpu_gemv, "enabled", False)
    ref, _ = load_source_model(src_dir, lazy=False)  # mlx-lm's model of the same directory
    want_tokens, want_logits = greedy(ref, mlx_lm_generate_step), ref(PROMPT[None])
    fd = FlashDir(flash_dir)
    for name, budget in budgets(fd, exact=True).items():  # (mlx-lm's float results: float32 keys and values)
        model, _ = load(flash_dir, memory_budget=budget, context=CONTEXT, prefetch="read ahead" in name, exact=True)
        engine = model.flash
        routed = set()  # experts per token as the model's router hands them to the engine
        experts = engine.experts
        engine.experts = lambda layer, x, indices, act: routed.add(indices.shape[-1]) or experts(layer, x, indices, act)
        try:
            assert greedy(model) == want_tokens, name
            assert mx.abs(model(PROMPT[None]) - want_logits).max().item() < 1e-4, name
            assert routed == {fd.ffn["experts_per_token"]}
            slots = {c[REGION] for c in engine.plan.capacity if REGION in c}
            if name.startswith(("25%", "50%")):
                assert slots == {int(name[:2]) * fd.ffn["n_experts"] // 100}, name
                assert {g.kind for g in engine.plan.streamed} <= {"rows"}, name
            if name == "below floor":
                assert engine.plan.streamed and {g.kind for g in engine.plan.streamed} >= {"layer"}
                engine.stats.end()
                assert sum(t.streamed_bytes for t in engine.stats.tokens) > 0
        finally:
            engine.close()


def test_the_default_mode_gives_the_same_tokens_at_every_budget(converted):
    """int8 activations (the CPU's default): the tokens and logits with every expert cached, whatever the budget."""
    arch, _, flash_dir = converted
    want_tokens = want_logits = None
    for name, budget in budgets(FlashDir(flash_dir)).items():
        model, _ = load(flash_dir, memory_budget=budget, context=CONTEXT, prefetch="read ahead" in name)
        try:
            tokens, logits = greedy(model), model(PROMPT[None])
        finally:
            model.flash.close()
        if want_tokens is None:
            want_tokens, want_logits = tokens, logits
        assert tokens == want_tokens, name
        assert mx.array_equal(logits, want_logits), name


def test_flash_generate_loop_on_a_wrapper(tmp_path, float_activations):
    """A multimodal wrapper (its `model` a read-only property) through mlx_flash's own loop, against mlx-lm's."""
    src = make_tiny_quantized_dir(published("qwen3_5_moe", ARCHS["qwen3_5_moe"]), tmp_path / "src")
    ref, _ = load_source_model(src, lazy=False)
    model, _ = load(convert(str(src), tmp_path / "flash", progress=False), context=CONTEXT)
    try:
        assert greedy(model) == greedy(ref, mlx_lm_generate_step)
    finally:
        model.flash.close()


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_with_one_line(arch, tmp_path):
    config, why = REFUSED[arch]
    src = make_tiny_quantized_dir(published(arch, config), tmp_path / "src")
    with pytest.raises(UnsupportedArchitectureError, match=why) as e:
        convert(str(src), tmp_path / "flash", progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "flash").exists()


def test_a_config_mlx_lm_cannot_build_is_refused_naming_the_key(tmp_path):
    config = published("ernie4_5_moe", ARCHS["ernie4_5_moe"])
    src = make_tiny_quantized_dir(config, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    del config["moe_num_experts"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="'ernie4_5_moe' is not supported.*moe_num_experts"):
        convert(str(src), tmp_path / "flash", progress=False)


def test_experts_per_token_not_found_is_one_clear_line():
    model = instantiate(published("qwen3_moe", ARCHS["qwen3_moe"]))
    for layer in model.layers:
        del layer.mlp.top_k
    model.args.num_experts_per_tok = None
    with pytest.raises(UnsupportedArchitectureError, match="model.layers.0.mlp.switch_mlp: the number of experts per"):
        experts_per_token(model, switch_paths(model))


def test_percent_budgets_of_a_small_model(tmp_path):
    """The workspace scales with the model (an eighth of it at most): 25% of a 13 MB MoE model streams, with the same
    tokens as with every expert cached (the default int8 activations: the same bits at every budget)."""
    src = make_tiny_model_dir(
        "qwen3_moe", tmp_path / "src", hidden_size=128, moe_intermediate_size=128, num_experts=32, num_hidden_layers=2
    )
    path = convert(str(src), tmp_path / "flash", progress=False)
    tokens = {}
    for budget in (None, "50%", "25%"):
        model, _ = load(path, memory_budget=budget, context=CONTEXT)
        try:
            tokens[budget] = greedy(model)
            assert budget is None or 0 < model.flash.plan.capacity[0]["experts"] < 32
        finally:
            model.flash.close()
    assert tokens["25%"] == tokens["50%"] == tokens[None]
