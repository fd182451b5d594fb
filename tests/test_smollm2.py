"""The default model, SmolLM2-135M-Instruct (real Q4_1 GGUF weights), through convert and the resident-only loader."""

from mlx_flash.convert import convert
from mlx_flash.convert.gguf import gguf_to_mlx_dir
from mlx_flash.convert.source import load_source_model
from mlx_flash.default_model import default_gguf_path
from mlx_flash.engine.sparsity import Oracle
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load_resident, load_tokenizer
from mlx_flash.models.architectures import ADAPTERS

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step

PROMPT = "The history of the city begins"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # float32 scales: float16 x float16 quantised matmuls are ~35x slower on the CPU
    src_dir = gguf_to_mlx_dir(default_gguf_path(), tmp_path_factory.mktemp("smol") / "src", dtype="float32")
    model, _ = load_source_model(src_dir, lazy=False)
    return src_dir, model


@pytest.fixture(scope="module")
def flash_exact(source, tmp_path_factory):
    return convert(str(source[0]), tmp_path_factory.mktemp("smol") / "exact", down_bits="float", progress=False)


def test_bundles_bit_exact(source, flash_exact):
    src_dir, src = source
    fd = FlashDir(flash_exact)
    assert fd.manifest["quantization"] == {"bits": 4, "group_size": 32}
    adapter = ADAPTERS["llama"]
    for i in range(len(fd.layers)):
        arrays = fd.unpack_layer(i)
        linears = adapter.linears(src.layers[i].mlp)
        for name in ("gate", "up"):
            for key in ("weight", "scales", "biases"):
                assert np.array_equal(np.array(arrays[f"{name}.{key}"]), np.array(linears[name][key])), (i, name, key)
        d = linears["down"]
        dense = mx.dequantize(d["weight"], d["scales"], d["biases"], 32, 4)
        assert np.array_equal(np.array(arrays["down.weight"]), np.array(dense.T)), i


def _greedy(model, prompt, n=32):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.usefixtures("float_activations")  # against stock mlx-lm's float arithmetic
def test_resident_logits_and_greedy_tokens(source, flash_exact, tmp_path):
    _, src = source
    model, fd = load_resident(flash_exact)
    prompt = load_tokenizer(fd).encode(PROMPT)
    diff = mx.abs(model(mx.array([prompt])) - src(mx.array([prompt]))).max().item()
    assert diff < 1e-3, diff
    assert _greedy(model, prompt) == _greedy(src, prompt)


def _perplexity(model, tokens):
    logits = model(tokens[None, :-1]).astype(mx.float32)
    return float(mx.exp(nn.losses.cross_entropy(logits[0], tokens[1:]).mean()))


def test_default_conversion_keeps_the_source_weights(source, flash_exact, tmp_path, wikitext):
    """The default conversion keeps down_proj's own 4-bit codes per neuron (group scales resident), so its
    perplexity is the source's (96 WikiText-2 tokens; re-quantising down to 8 bits, the old default, moved it ~1%)."""
    out = convert(str(source[0]), tmp_path / "default", progress=False)
    q = FlashDir(out).ffn["matrices"]["down"]["quantization"]
    assert q["bits"] == 4 and q["resident_scales"]
    model, _ = load_resident(out)
    tok = load_tokenizer(FlashDir(flash_exact))
    tokens = mx.array(tok.encode(wikitext[:6000])[:97])  # short: CPU quantised matmuls are slow
    ref, ppl = _perplexity(source[1], tokens), _perplexity(model, tokens)
    assert abs(ppl / ref - 1) < 1e-3, (ppl, ref)


def test_default_directory_holds_the_gguf_bytes(tmp_path):
    """convert of the GGUF itself with no flag: the Q8_0 embedding's biases (-128 x its scales) are not stored
    (format v4) yet load back exactly, so the weights on disk are the GGUF's tensor bytes within 1% (they were
    1.8% over with the biases stored), and the directory as a whole is no larger than the GGUF."""
    from mlx_flash.format.quant import symmetric_biases

    import gguf

    out = convert(str(default_gguf_path()), tmp_path / "default", progress=False)
    fd = FlashDir(out)
    assert fd.version == 4 and fd.symmetric == {"model.embed_tokens": 8}
    assert "model.embed_tokens.biases" not in fd.resident_index()
    stored = fd.load_resident()
    scales = stored["model.embed_tokens.scales"]
    assert mx.array_equal(stored["model.embed_tokens.biases"], symmetric_biases(scales, 8))
    assert "model.embed_tokens.biases" not in fd.load_resident(biases=False)
    gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(default_gguf_path()).tensors)
    weights = fd.resident_bytes + (out / "ffn.bin").stat().st_size
    assert abs(weights / gguf_bytes - 1) < 0.01, (weights, gguf_bytes)
    # the whole directory, tokenizer included, is no larger than the GGUF file (pretty-printed, tokenizer.json
    # alone took 3.5 MB and the directory 1.02x); besides it, 4 bytes of checksum a unit
    directory = sum(f.stat().st_size for f in out.iterdir() if f.name != "units.crc32")
    assert directory <= default_gguf_path().stat().st_size, directory
    assert (out / "units.crc32").stat().st_size == 4 * sum(r.n_units for r in fd.regions())


def test_tokenizer_in_flash_dir(flash_exact):
    tok = load_tokenizer(FlashDir(flash_exact))
    text = "Hello, world! 12345 <|im_start|>user\n  café\tdone"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(" the")) == 1 and len(tok.encode("2024")) == 4  # byte-level BPE, single digits


@pytest.mark.usefixtures("float_activations")  # against stock mlx-lm
def test_oracle_streaming_equals_mlx_lm(source, flash_exact):
    """Oracle sparsity streams the FFN through caches of 10% of it, and gives mlx-lm's own 64 greedy tokens."""
    from mlx_flash.budget import min_budget
    from mlx_flash.loader import load

    fd = FlashDir(flash_exact)
    prompt = load_tokenizer(fd).encode(PROMPT)
    model, _ = load(
        flash_exact,
        memory_budget=min_budget(fd, 128, kv_size_of(fd)) + fd.ffn_bytes // 10 + Oracle(fd).nbytes,
        sparsity="oracle",
        context=128,
    )
    try:
        assert _greedy(model, prompt, 64) == _greedy(source[1], prompt, 64)
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()
        assert sum(t.misses for t in toks) > 0 and all(t.bytes_read > 0 for t in toks)
    finally:
        model.flash.close()
