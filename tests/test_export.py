"""mlx_flash.convert.export: a flash directory written back as a stock mlx-lm model directory."""

import json

from mlx_flash.convert import convert
from mlx_flash.convert.export import export
from mlx_flash.loader import load_resident, load_tokenizer
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

PROMPT = "Hello, tiny world!"


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    src = make_tiny_model_dir("llama", root / "src")
    return convert(
        str(src), root / "flash", bits=4, group_size=32, down_bits="8", progress=False
    )  # down 8-bit per neuron


def _greedy(model, tokenizer, n=12):
    return mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=n)


@pytest.mark.usefixtures("float_activations")  # against stock mlx-lm
@pytest.mark.parametrize("down_bits,tol", [("float", 1e-2), ("8", 5e-2)])
def test_mlx_lm_runs_the_flash_weights(flash_dir, tmp_path, down_bits, tol):
    out = export(flash_dir, tmp_path / "mlx", down_bits, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    if down_bits == "8":
        assert config["quantization"]["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}

    ref, fd = load_resident(flash_dir)
    model, tokenizer = mlx_lm.load(str(out))
    ids = mx.array(load_tokenizer(fd).encode(PROMPT))[None]
    a, b = np.array(ref(ids).astype(mx.float32)), np.array(model(ids).astype(mx.float32))
    assert np.abs(a - b).max() < tol * np.abs(a).max()
    assert _greedy(model, tokenizer) == _greedy(ref, load_tokenizer(fd))


def test_gate_up_are_copied_bit_for_bit(flash_dir, tmp_path):
    from mlx_flash.format.directory import FlashDir

    out = export(flash_dir, tmp_path / "mlx", progress=False)
    w = mx.load(str(out / "model.safetensors"))
    stored = FlashDir(flash_dir).unpack_layer(1)
    for k in ("weight", "scales", "biases"):
        assert mx.array_equal(w[f"model.layers.1.mlp.gate_proj.{k}"], stored[f"gate.{k}"])
        assert mx.array_equal(w[f"model.layers.1.mlp.up_proj.{k}"], stored[f"up.{k}"])


def test_resident_blocks_export_as_their_values(tmp_path, monkeypatch):
    """An MoE GGUF of the Q2_K mix (experts in place, resident matrices kept as its GGML blocks) exports for mlx-lm
    with the same values: Q4_K blocks as MLX affine codes, the other types as float32; mlx-lm's model computes the
    logits of the directory's own (MLX's ops on both)."""
    from mlx_flash.compute import cpu_gemv
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    monkeypatch.setattr(cpu_gemv, "enabled", False)
    shape = {**tiny_moe("qwen3_moe"), "hidden_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 2}
    src = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, gguf_type="Q2_K", **shape)
    flash = convert(str(src), tmp_path / "flash", progress=False)
    kinds = set(FlashDir(flash).blocks.values())
    assert {"Q2_K", "Q6_K"} <= kinds
    out = export(flash, tmp_path / "mlx", progress=False)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    for path, kind in FlashDir(flash).blocks.items():
        assert quant[path] == ({"group_size": 32, "bits": 4} if kind == "Q4_K" else False), path
    ref, fd = load_resident(flash, mx.float32)
    model, _ = mlx_lm.load(str(out))
    ids = mx.array(load_tokenizer(fd).encode(PROMPT))[None]
    a, b = np.array(ref(ids).astype(mx.float32)), np.array(model(ids).astype(mx.float32))
    assert np.abs(a - b).max() < 1e-4 * np.abs(a).max()
