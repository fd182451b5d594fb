"""mlx_flash.models.opt against an independent numpy port of HF's OPTForCausalLM.

The reference below works on Hugging Face weight names (fc1/fc2 at layer level,
lm_head tied to embed_tokens) in float64 and follows modeling_opt.py step by
step; the MLX model gets the same weights through `sanitize`.
"""

import json
import math

from mlx_flash.errors import UnsupportedArchitectureError
from mlx_flash.models import get_model_classes
from mlx_flash.models.opt import Model, ModelArgs

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

TOL = 1e-4

BASE = dict(
    model_type="opt",
    hidden_size=64,
    ffn_dim=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=64,
    do_layer_norm_before=True,
    word_embed_proj_dim=64,
    activation_function="relu",
    enable_bias=True,
    layer_norm_elementwise_affine=True,
    tie_word_embeddings=True,
)

VARIANTS = {
    "pre_ln": {},
    "post_ln": {"do_layer_norm_before": False},
    "project_in_out": {"word_embed_proj_dim": 32},
    "opt350m_like": {"do_layer_norm_before": False, "word_embed_proj_dim": 32},
    "untied_lm_head": {"tie_word_embeddings": False},
    "no_bias_no_affine": {"enable_bias": False, "layer_norm_elementwise_affine": False},
    "gelu": {"activation_function": "gelu"},
}


def make_config(**overrides):
    return {**BASE, **overrides}


# ---------------------------------------------------------------- HF weights


def hf_weights(cfg, seed=0):
    """Random HF-named OPT weights (numpy float32)."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["ffn_dim"], cfg["vocab_size"]
    p = cfg.get("word_embed_proj_dim") or d
    bias, affine = cfg["enable_bias"], cfg["layer_norm_elementwise_affine"]

    def n(*shape, std=1.0):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {
        "model.decoder.embed_tokens.weight": n(v, p, std=0.5),
        "model.decoder.embed_positions.weight": n(cfg["max_position_embeddings"] + 2, d, std=0.5),
    }
    if p != d:
        w["model.decoder.project_in.weight"] = n(d, p, std=p**-0.5)
        w["model.decoder.project_out.weight"] = n(p, d, std=d**-0.5)

    def linear(prefix, out_dim, in_dim):
        w[prefix + ".weight"] = n(out_dim, in_dim, std=in_dim**-0.5)
        if bias:
            w[prefix + ".bias"] = n(out_dim, std=0.1)

    def layer_norm(prefix):
        if affine:
            w[prefix + ".weight"] = 1.0 + n(d, std=0.1)
            w[prefix + ".bias"] = n(d, std=0.1)

    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.decoder.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{pre}.self_attn.{name}", d, d)
        layer_norm(f"{pre}.self_attn_layer_norm")
        layer_norm(f"{pre}.final_layer_norm")
        linear(f"{pre}.fc1", f, d)
        linear(f"{pre}.fc2", d, f)
    if cfg["do_layer_norm_before"]:
        layer_norm("model.decoder.final_layer_norm")
    if cfg["tie_word_embeddings"]:
        # HF checkpoints often carry the tied head too; sanitize must drop it.
        w["lm_head.weight"] = w["model.decoder.embed_tokens.weight"].copy()
    else:
        w["lm_head.weight"] = n(v, p, std=p**-0.5)
    return w


# ---------------------------------------------------------- numpy reference


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


ACT = {"relu": lambda x: np.maximum(x, 0.0), "gelu": _gelu}


def ref_forward(w, cfg, ids):
    """HF OPTForCausalLM.forward(input_ids) with an all-ones attention mask."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    d, H = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = d // H
    pre_ln = cfg["do_layer_norm_before"]
    act = ACT[cfg["activation_function"]]
    ids = np.asarray(ids)
    T = ids.shape[-1]

    def linear(x, prefix):
        y = x @ w[prefix + ".weight"].T
        if prefix + ".bias" in w:
            y = y + w[prefix + ".bias"]
        return y

    def layer_norm(x, prefix):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        y = (x - mu) / np.sqrt(var + 1e-5)
        if prefix + ".weight" in w:
            y = y * w[prefix + ".weight"] + w[prefix + ".bias"]
        return y

    x = w["model.decoder.embed_tokens.weight"][ids]  # [T, p]
    if "model.decoder.project_in.weight" in w:
        x = x @ w["model.decoder.project_in.weight"].T
    # OPTLearnedPositionalEmbedding: cumsum(mask) * mask - 1, then + offset 2
    mask = np.ones(T, dtype=np.int64)
    positions = np.cumsum(mask) * mask - 1
    x = x + w["model.decoder.embed_positions.weight"][positions + 2]

    causal = np.triu(np.full((T, T), -np.inf), k=1)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.decoder.layers.{i}"
        residual = x
        h = layer_norm(x, f"{pre}.self_attn_layer_norm") if pre_ln else x
        q = linear(h, f"{pre}.self_attn.q_proj") * hd**-0.5
        k = linear(h, f"{pre}.self_attn.k_proj")
        v = linear(h, f"{pre}.self_attn.v_proj")
        q, k, v = (a.reshape(T, H, hd).transpose(1, 0, 2) for a in (q, k, v))
        s = q @ k.transpose(0, 2, 1) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T, d)
        x = residual + linear(o, f"{pre}.self_attn.out_proj")
        if not pre_ln:
            x = layer_norm(x, f"{pre}.self_attn_layer_norm")
        residual = x
        h = layer_norm(x, f"{pre}.final_layer_norm") if pre_ln else x
        h = linear(act(linear(h, f"{pre}.fc1")), f"{pre}.fc2")
        x = residual + h
        if not pre_ln:
            x = layer_norm(x, f"{pre}.final_layer_norm")
    if pre_ln:
        x = layer_norm(x, "model.decoder.final_layer_norm")
    if "model.decoder.project_out.weight" in w:
        x = x @ w["model.decoder.project_out.weight"].T
    head = w["model.decoder.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T  # [T, vocab]


# ------------------------------------------------------------------ helpers


def build(cfg, w):
    model = Model(ModelArgs.from_dict(cfg))
    weights = model.sanitize({k: mx.array(v) for k, v in w.items()})
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def prompt(cfg, T=12, seed=1):
    return np.random.default_rng(seed).integers(0, cfg["vocab_size"], size=T)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# -------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_forward_matches_reference(variant):
    cfg = make_config(**VARIANTS[variant])
    w = hf_weights(cfg)
    model = build(cfg, w)
    ids = prompt(cfg)
    out = model(mx.array(ids)[None])
    assert out.shape == (1, len(ids), cfg["vocab_size"])
    ref = ref_forward(w, cfg, ids)
    diff = max_diff(out[0], ref)
    print(f"{variant}: full forward max abs diff {diff:.2e}")
    assert diff < TOL
    # Not a trivially small comparison: logits vary by O(1).
    assert np.std(ref) > 0.3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_matches_full_forward(variant):
    cfg = make_config(**VARIANTS[variant])
    w = hf_weights(cfg)
    model = build(cfg, w)
    ids = prompt(cfg, T=14)
    full = np.array(model(mx.array(ids)[None])[0])
    ref = ref_forward(w, cfg, ids)

    # Prefill 5 tokens, a chunk of 4 (L > 1 with a cache offset), then 1 at a time.
    cache = make_prompt_cache(model)
    chunks = [ids[:5], ids[5:9]] + [ids[i : i + 1] for i in range(9, len(ids))]
    steps = []
    for chunk in chunks:
        steps.append(np.array(model(mx.array(chunk)[None], cache=cache)[0]))
    inc = np.concatenate(steps, axis=0)
    assert cache[0].offset == len(ids)
    d_full = max_diff(inc, full)
    d_ref = max_diff(inc, ref)
    print(f"{variant}: incremental vs full {d_full:.2e}, vs reference {d_ref:.2e}")
    assert d_full < TOL
    assert d_ref < TOL


def test_batched_left_padding_positions():
    """With mlx-lm's BatchKVCache (left padding), positions start at each row's
    first real token, as HF's attention-mask cumsum makes them."""
    from mlx_lm.models.cache import BatchKVCache

    cfg = make_config()
    w = hf_weights(cfg)
    model = build(cfg, w)
    a, b = prompt(cfg, T=9, seed=3), prompt(cfg, T=6, seed=4)
    pad = len(a) - len(b)
    batch = mx.array(np.stack([a, np.concatenate([np.zeros(pad, dtype=a.dtype), b])]))
    cache = [BatchKVCache(left_padding=[0, pad]) for _ in model.layers]
    out = np.array(model(batch, cache=cache))
    assert max_diff(out[0], ref_forward(w, cfg, a)) < TOL
    assert max_diff(out[1, pad:], ref_forward(w, cfg, b)) < TOL
    # One decode step per row continues from the right position.
    nxt = np.array([[5], [7]])
    step = np.array(model(mx.array(nxt), cache=cache))
    assert max_diff(step[0, 0], ref_forward(w, cfg, np.append(a, 5))[-1]) < TOL
    assert max_diff(step[1, 0], ref_forward(w, cfg, np.append(b, 7))[-1]) < TOL


def test_ffn_lives_in_mlp_submodule():
    cfg = make_config()
    model = build(cfg, hf_weights(cfg))
    for layer in model.layers:
        assert set(layer.mlp.children()) >= {"fc1", "fc2"}
        x = mx.random.normal((3, cfg["hidden_size"]))
        expect = layer.mlp.fc2(mx.maximum(layer.mlp.fc1(x), 0))
        assert max_diff(layer.mlp(x), expect) == 0.0
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert "model.decoder.layers.0.mlp.fc1.weight" in names
    assert not any(".layers.0.fc1" in k for k in names)


@pytest.mark.parametrize("prefix", ["", "decoder_only"])
def test_sanitize_round_trip_strict(prefix):
    cfg = make_config()
    w = hf_weights(cfg)
    assert "model.decoder.layers.1.fc1.weight" in w and "lm_head.weight" in w
    if prefix == "decoder_only":  # checkpoints saved from OPTModel: "decoder.*"
        w = {(k[len("model.") :] if k.startswith("model.") else k): v for k, v in w.items()}
    model = Model(ModelArgs.from_dict(cfg))
    sanitized = model.sanitize({k: mx.array(v) for k, v in w.items()})
    assert "lm_head.weight" not in sanitized
    assert "model.decoder.layers.1.mlp.fc1.weight" in sanitized
    assert "model.decoder.layers.1.mlp.fc2.bias" in sanitized
    assert not any(".layers.1.fc" in k for k in sanitized)
    model.load_weights(list(sanitized.items()), strict=True)
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(sanitized)
    src = w["decoder.layers.1.fc2.weight" if prefix else "model.decoder.layers.1.fc2.weight"]
    assert max_diff(params["model.decoder.layers.1.mlp.fc2.weight"], src) == 0.0


def test_untied_lm_head_is_kept():
    cfg = make_config(tie_word_embeddings=False)
    w = hf_weights(cfg)
    model = Model(ModelArgs.from_dict(cfg))
    sanitized = model.sanitize({k: mx.array(v) for k, v in w.items()})
    assert "lm_head.weight" in sanitized
    model.load_weights(list(sanitized.items()), strict=True)


def _save_dir(tmp_path, cfg, w):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, "architectures": ["OPTForCausalLM"]}, f)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    return tmp_path


def test_load_model_and_generate(tmp_path):
    from mlx_flash.models.tiny import save_tiny_tokenizer

    from mlx_lm import generate
    from mlx_lm.utils import load_model, load_tokenizer

    cfg = make_config(vocab_size=256)
    w = hf_weights(cfg, seed=5)
    d = _save_dir(tmp_path, cfg, w)
    save_tiny_tokenizer(d)

    model, config = load_model(d, get_model_classes=get_model_classes)
    assert isinstance(model, Model) and config["model_type"] == "opt"
    tok = load_tokenizer(d)
    ids = tok.encode("hi there")
    assert max_diff(model(mx.array(ids)[None])[0], ref_forward(w, cfg, ids)) < TOL

    # Greedy generation through mlx-lm's KV cache equals greedy decoding with
    # the reference's full recomputation at every step.
    n = 6
    text = generate(model, tok, "hi there", max_tokens=n, verbose=False)
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(ref_forward(w, cfg, seq)[-1])))
    assert text == tok.decode(seq[len(ids) :])


def test_get_model_classes():
    from mlx_lm.models import llama

    assert get_model_classes({"model_type": "opt"}) == (Model, ModelArgs)
    assert get_model_classes({"model_type": "llama"}) == (llama.Model, llama.ModelArgs)
    assert get_model_classes({"model_type": "mistral"}) == (llama.Model, llama.ModelArgs)


def test_unknown_model_type_raises(tmp_path):
    from mlx_lm.utils import load_model

    with pytest.raises(UnsupportedArchitectureError, match="not_a_real_arch"):
        get_model_classes({"model_type": "not_a_real_arch"})
    with pytest.raises(UnsupportedArchitectureError):
        get_model_classes({})
    cfg = make_config(model_type="not_a_real_arch")
    d = _save_dir(tmp_path, cfg, hf_weights(make_config()))
    with pytest.raises(UnsupportedArchitectureError):
        load_model(d, get_model_classes=get_model_classes)


def test_bad_activation_rejected():
    with pytest.raises(ValueError, match="activation"):
        ModelArgs.from_dict(make_config(activation_function="bogus"))
