"""Tiny random model directories for tests and examples.

`make_tiny_model_dir(arch, out_dir)` writes what `mlx_lm.utils.load_model`
(with `mlx_flash.models.get_model_classes`) and `mlx_lm.utils.load_tokenizer`
read: config.json, model.safetensors (float32, Hugging Face weight names) and
a byte-level tokenizer (tokenizer.json + tokenizer_config.json).

Shapes are small (hidden 64, 2 layers, 4 heads, 2 KV heads where the
architecture has GQA, vocab 256) and the weights are random, scaled so that
activations and logits stay O(1): Linear weights ~ N(0, 1/fan_in), embeddings
~ N(0, 1/hidden), norms ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.02^2).

The tokenizer maps the 256 bytes to ids 0..255 (no merges) and has no special
tokens, so with the default vocab of 256 there is no EOS and generation always
runs for max_tokens. With `vocab_size > 256`, id 256 is an "<|endoftext|>"
EOS token. (transformers' AutoTokenizer loads a "qwen2" dir as Qwen2Tokenizer,
which adds "<|endoftext|>" as id 256 whatever the vocab; plain text never
encodes to it.)
"""

import copy
import json
import re
from pathlib import Path
from typing import Dict, Union

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import get_model_classes

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "opt")
TINY_MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")

_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}

_CONFIGS = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "intermediate_size": 160,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "intermediate_size": 192,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "intermediate_size": 128,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "intermediate_size": 128,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "intermediate_size": 176,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"],
        "intermediate_size": 128,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    # mixture-of-experts (experts written stacked, as mlx-lm's sanitize leaves them)
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "olmoe": {
        "architectures": ["OlmoeForCausalLM"],
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # many small experts, a shared one, group-limited sigmoid routing, MLA attention, a dense first layer
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "num_key_value_heads": 4,
        "num_hidden_layers": 3,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # experts with biases and a clamped SwiGLU; attention sinks, sliding and full layers
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,  # (transformers checks it against its default YaRN factor)
    },
    "opt": {
        "architectures": ["OPTForCausalLM"],
        "ffn_dim": 256,
        "word_embed_proj_dim": 64,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
    },
}


def tiny_config(arch: str, **overrides) -> dict:
    """The config.json contents `make_tiny_model_dir` writes for `arch`."""
    if arch not in _CONFIGS:
        raise ValueError(f"Unknown tiny arch {arch!r}; choose from {TINY_ARCHS + TINY_MOE_ARCHS}")
    config = {"model_type": arch, **copy.deepcopy(_COMMON), **copy.deepcopy(_CONFIGS[arch])}
    config.update(overrides)
    # Explicit ids, so transformers' per-architecture defaults (e.g. phi3's
    # 32000) do not leak in through AutoConfig when the tokenizer is loaded.
    eos = 256 if config["vocab_size"] > 256 else None
    for key, value in (("bos_token_id", None), ("eos_token_id", eos), ("pad_token_id", None)):
        config.setdefault(key, value)
    return config


def _random_weights(model, config: dict, rng: np.random.Generator) -> Dict[str, mx.array]:
    gemma_norms = config["model_type"] in ("gemma3_text",)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if len(shape) >= 2:  # matrices ~ N(0, 1/fan_in); an embedding's rows ~ N(0, 1/hidden)
            w = rng.standard_normal(shape) * shape[-1] ** -0.5
        elif name.endswith("bias"):
            w = rng.standard_normal(shape) * 0.02
        else:  # norm scales; Gemma stores them as an offset from 1
            w = (0.0 if gemma_norms else 1.0) + rng.standard_normal(shape) * 0.1
        weights[name] = mx.array(w.astype(np.float32))
    return weights


def _to_hf_names(weights: Dict[str, mx.array], config: dict) -> Dict[str, mx.array]:
    """Module parameter names -> checkpoint names (what `sanitize` undoes)."""
    out = dict(weights)
    if config.get("tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    if config["model_type"] == "opt":
        out = {re.sub(r"\.mlp\.(fc[12]\.)", r".\1", k): v for k, v in out.items()}
    mixtral = config["model_type"] == "mixtral"
    for k in [k for k in out if ".switch_mlp." in k]:  # stacked experts -> one tensor per expert, as HF stores them
        stacked = out.pop(k)
        prefix, proj, part = re.match(r"(.*)\.switch_mlp\.(\w+)\.(\w+)$", k).groups()
        name = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj] if mixtral else proj
        for e in range(stacked.shape[0]):
            out[f"{prefix}.experts.{e}.{name}.{part}"] = stacked[e]
    return out


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable unicode character map (ByteLevel's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save_tiny_tokenizer(out_dir: Union[str, Path], vocab_size: int = 256) -> None:
    """Write a byte-level BPE tokenizer (byte b -> id b, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    kwargs = {}
    if vocab_size > 256:
        tok.add_special_tokens(["<|endoftext|>"])
        kwargs = {"eos_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.save_pretrained(str(out_dir))


def make_tiny_model_dir(arch: str, out_dir: Union[str, Path], seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of `arch` (one of TINY_ARCHS) into `out_dir`.

    `overrides` replace config.json entries (e.g. `num_hidden_layers=3`,
    `tie_word_embeddings=False`, `do_layer_norm_before=False`). Returns the
    directory as a Path.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)

    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = _random_weights(model, config, np.random.default_rng(seed))
    weights = _to_hf_names(weights, config)

    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_tiny_tokenizer(out_dir, vocab_size=config["vocab_size"])
    return out_dir


def make_tiny_quantized_dir(
    config: dict, out_dir: Union[str, Path], bits: int = 4, group_size: int = 32, seed: int = 0
):
    """Write a tiny random model of any mlx-lm architecture `config` describes (config.json as published, e.g. a
    nested text_config) as mlx-lm's convert writes a quantised one: its own parameter names, the config with its
    "quantization", and the byte-level tokenizer. Returns the directory as a Path."""
    from mlx_lm.utils import quantize_model, save_model

    out_dir = Path(out_dir)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.load_weights(list(_random_weights(model, config, np.random.default_rng(seed)).items()))
    model, config = quantize_model(model, copy.deepcopy(config), group_size=group_size, bits=bits)
    save_model(out_dir, model)
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    save_tiny_tokenizer(out_dir)
    return out_dir
