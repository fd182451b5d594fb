"""mlx_flash.models.tiny: every tiny arch loads through mlx-lm and runs."""

import json

from mlx_flash.models import get_model_classes
from mlx_flash.models.tiny import TINY_ARCHS, make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

EXPECTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "opt")


def test_arch_list():
    assert set(TINY_ARCHS) == set(EXPECTED_ARCHS)


@pytest.mark.parametrize("arch", EXPECTED_ARCHS)
def test_tiny_model_loads_and_runs(arch, tmp_path):
    d = make_tiny_model_dir(arch, tmp_path / arch)
    assert (d / "config.json").exists() and (d / "model.safetensors").exists()
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["vocab_size"] == 256

    saved = mx.load(str(d / "model.safetensors"))
    assert all(v.dtype == mx.float32 for v in saved.values())

    model, _ = load_model(d, get_model_classes=get_model_classes)
    assert len(model.layers) == 2
    for layer in model.layers:
        assert hasattr(layer, "mlp")

    tok = load_tokenizer(d)
    text = "Hello, tiny world!"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text

    logits = model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), 256)
    ref = np.array(logits[0].astype(mx.float32))
    assert np.isfinite(ref).all()
    # Non-degenerate: logits spread O(1), next-token distribution neither
    # one-hot nor uniform, and different positions predict different things.
    assert 0.2 < ref.std() < 10.0
    p = np.exp(ref[-1] - ref[-1].max())
    p /= p.sum()
    entropy = float(-(p * np.log(p)).sum())
    assert 1.0 < entropy < np.log(256) - 0.05
    assert np.abs(ref[0] - ref[-1]).max() > 0.1

    # KV-cached decoding gives the same logits as the full forward.
    cache = make_prompt_cache(model)
    steps = [np.array(model(mx.array(ids[:4])[None], cache=cache)[0])]
    for t in ids[4:]:
        steps.append(np.array(model(mx.array([[t]]), cache=cache)[0]))
    inc = np.concatenate(steps)
    assert np.abs(inc - ref).max() < 1e-4

    out = generate(model, tok, "abc", max_tokens=4, verbose=False)
    assert isinstance(out, str) and len(tok.encode(out)) >= 1


def test_seed_and_overrides(tmp_path):
    a = mx.load(str(make_tiny_model_dir("llama", tmp_path / "a", seed=3) / "model.safetensors"))
    b = mx.load(str(make_tiny_model_dir("llama", tmp_path / "b", seed=3) / "model.safetensors"))
    c = mx.load(str(make_tiny_model_dir("llama", tmp_path / "c", seed=4) / "model.safetensors"))
    k = "model.layers.0.mlp.up_proj.weight"
    assert mx.array_equal(a[k], b[k]) and not mx.array_equal(a[k], c[k])

    d = make_tiny_model_dir("qwen3", tmp_path / "d", num_hidden_layers=3, intermediate_size=96)
    model, config = load_model(d, get_model_classes=get_model_classes)
    assert len(model.layers) == 3 and config["intermediate_size"] == 96
    assert model.layers[0].mlp.up_proj.weight.shape == (96, 64)


def test_opt_dir_uses_hf_names(tmp_path):
    d = make_tiny_model_dir("opt", tmp_path / "opt", do_layer_norm_before=False)
    saved = mx.load(str(d / "model.safetensors"))
    assert "model.decoder.layers.0.fc1.weight" in saved
    assert not any(".mlp." in k for k in saved)
    assert "lm_head.weight" not in saved  # tied
    assert "model.decoder.final_layer_norm.weight" not in saved  # post-LN OPT has none
    model, _ = load_model(d, get_model_classes=get_model_classes)
    assert model.layers[1].mlp.fc1.weight.shape == (256, 64)


def test_larger_vocab_has_eos(tmp_path):
    d = make_tiny_model_dir("llama", tmp_path / "v", vocab_size=260)
    config = json.loads((d / "config.json").read_text())
    assert config["eos_token_id"] == 256
    tok = load_tokenizer(d, eos_token_ids=config["eos_token_id"])
    assert 256 in tok.eos_token_ids
    assert tok.encode("<|endoftext|>") == [256]
    model, _ = load_model(d, get_model_classes=get_model_classes)
    assert model(mx.array([[1, 2, 256]])).shape == (1, 3, 260)


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model_dir("gpt_nope", tmp_path)
