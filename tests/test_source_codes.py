"""convert --down-bits source: down_proj's codes per neuron, exactly as the source quantised them, the
groups' scales and biases resident (cpu_gemv.block_axpy / block_matmul, compute.block_row_axpy)."""

from mlx_flash import FlashError
from mlx_flash.budget import min_budget
from mlx_flash.compute import cpu_gemv
from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir, dense_ffn_weights
from mlx_flash.format.quant import symmetric_biases
from mlx_flash.loader import kv_size_of, load, load_resident
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step

CONTEXT = 128
PROMPT = [1, 5, 9, 33, 7, 100, 3]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("src-codes")
    src = make_tiny_model_dir("llama", root / "src", num_hidden_layers=3)
    return src, convert(
        str(src), root / "flash", bits=4, group_size=32, down_bits="source", alignment=512, progress=False
    )


def greedy(model, n=24):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def test_down_is_the_source_quantisation_exactly(dirs):
    """The stored codes and resident group scales give back mx.quantize's down_proj bit for bit, in bundles
    of gate and up rows plus 4-bit codes."""
    src, path = dirs
    fd = FlashDir(path)
    assert fd.ffn["matrices"]["down"]["quantization"] == {"bits": 4, "group_size": 32, "resident_scales": True}
    comps = {c.name: c.nbytes for c in fd.layouts["neurons"].components}
    assert [c for c in comps if c.startswith("down.")] == ["down.weight"]
    w = mx.load(str(src / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    want = mx.dequantize(*mx.quantize(w, 32, 4), 32, 4).astype(mx.float32).T  # canonical [n, d]
    got = dense_ffn_weights(fd, 1)["down"]
    assert mx.array_equal(got, want)
    assert comps["down.weight"] == fd.ffn["hidden_size"] // 2  # 4-bit codes, nothing else


@pytest.mark.usefixtures("float_activations")  # (the int8 default: tests/test_decode.py)
def test_native_block_axpy_equals_mlx_ops():
    rng = np.random.default_rng(0)
    k, n, nb = 40, 96, 6
    for bits in (2, 4, 8):
        codes = mx.array(rng.integers(0, 2**32, (k, n * bits // 32), dtype=np.uint64).astype(np.uint32))
        blocks = np.sort(rng.integers(0, nb, k)).astype(np.int32)
        S, B = (mx.array(rng.standard_normal((nb, n)).astype(np.float16)) for _ in range(2))
        c = rng.standard_normal(k).astype(np.float32)
        c[3] = 0.0
        q = np.array(mx.dequantize(codes, mx.ones((k, n // 32)), mx.zeros((k, n // 32)), 32, bits))
        want = c @ (np.array(S.astype(mx.float32))[blocks] * q + np.array(B.astype(mx.float32))[blocks])
        ops = cpu_gemv.block_matmul(mx.array(c)[None], codes, mx.array(blocks), S, B, bits)  # two-dim: MLX ops
        assert np.allclose(np.array(ops)[0], want, atol=1e-3 * np.abs(want).max())
        # rows in slots of a wider buffer at an offset, in any order
        slots = rng.permutation(k).astype(np.int32)
        stride = n * bits // 8 + 16
        buf = np.zeros((k, stride), np.uint8)
        buf[slots, 8 : 8 + n * bits // 8] = np.array(codes).view(np.uint8)
        for order in (np.arange(k), rng.permutation(k)):
            got = cpu_gemv.block_axpy(c[order], buf.reshape(-1), 8, stride, slots[order], blocks[order], S, B, n, bits)
            assert np.allclose(got, want, atol=1e-3 * np.abs(want).max())
        with pytest.raises(IndexError):
            cpu_gemv.block_axpy(c, buf.reshape(-1), 8, stride, slots, np.full(k, nb, np.int32), S, B, n, bits)
        with pytest.raises(IndexError):
            cpu_gemv.block_axpy(c, buf.reshape(-1), 8, stride, slots + k, blocks, S, B, n, bits)


@pytest.mark.parametrize("sparsity,prefetch", [("dense", True), ("dense", False), ("oracle", False)])
def test_streamed_tokens_equal_the_resident_model(dirs, sparsity, prefetch):
    """Under a budget of a fraction of the FFN, streaming through block_row_axpy gives the resident model's
    tokens (ResidentFFN through block_matmul), the resident tables counted in the budget."""
    from mlx_flash.engine.sparsity import Oracle

    _, path = dirs
    ref, fd = load_resident(path)
    budget = (
        min_budget(fd, CONTEXT, kv_size_of(fd))
        + int(0.6 * fd.ffn_bytes)
        + (Oracle(fd).nbytes if sparsity == "oracle" else 0)
    )
    model, _ = load(path, memory_budget=budget, sparsity=sparsity, context=CONTEXT, prefetch=prefetch)
    try:
        assert greedy(model) == greedy(ref)
        model.flash.stats.end()
        assert sum(t.misses for t in model.flash.stats.decode_tokens()) > 0
        tables = sum(
            fd.resident_index()[f"{p}.down.{k}"].nbytes for p in fd.ffn["mlp_paths"] for k in ("scales", "biases")
        )
        assert model.flash.plan.resident >= tables > 0
    finally:
        model.flash.close()


def test_refused_where_it_cannot_apply(dirs, tmp_path):
    src, _ = dirs
    with pytest.raises(FlashError, match="--down-bits source"):
        convert(str(src), tmp_path / "dip", bits=4, down_bits="source", layout="dip", progress=False)
    with pytest.raises(FlashError, match="--down-bits source"):
        convert(str(src), tmp_path / "float", down_bits="source", progress=False)  # float model, no --bits


def test_export_gives_back_the_source_quantisation(dirs, tmp_path):
    """mlx_flash.convert.export of a source-codes directory writes down_proj exactly as mlx-lm quantises it."""
    from mlx_flash.convert.export import export

    src, path = dirs
    out = export(path, tmp_path / "mlx", progress=False)
    w = mx.load(str(src / "model.safetensors"))["model.layers.2.mlp.down_proj.weight"]
    got = {k: v for f in out.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    for k, want in zip(("weight", "scales", "biases"), mx.quantize(w, 32, 4)):
        assert mx.array_equal(got[f"model.layers.2.mlp.down_proj.{k}"], want), k


@pytest.mark.usefixtures("float_activations")
def test_a_symmetric_source_stores_no_biases(tmp_path):
    """A Q4_0 GGUF (llama.cpp's symmetric 4-bit: bias = -8 * scale) keeps its codes and scales only: bundles of
    gate/up rows without biases plus down codes, no resident down biases; the weights are the GGUF's exactly
    and dense streaming gives the resident model's tokens."""
    from mlx_flash.convert.source import load_source_model, resolve_source
    from mlx_flash.tools.synthetic_gguf import write_gguf

    gguf = write_gguf("tiny", tmp_path / "tiny.gguf", progress=False, vocab_size=320)
    path = convert(str(gguf), tmp_path / "flash", down_bits="source", alignment=512, progress=False)
    fd = FlashDir(path)
    for name in ("gate", "up", "down"):
        assert fd.ffn["matrices"][name]["quantization"]["symmetric"] is True
    comps = {c.name for c in fd.layouts["neurons"].components}
    assert comps == {"gate.weight", "gate.scales", "up.weight", "up.scales", "down.weight"}
    assert not any(k.endswith("down.biases") for k in fd.resident_index())
    src, _ = load_source_model(resolve_source(str(gguf), tmp_path))
    mlp = src.layers[2].mlp
    weights = dense_ffn_weights(fd, 2)
    for name, lin in (("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
        dtype = mx.float32 if name == "down" else lin.scales.dtype  # as dense_ffn_weights computes each
        want = mx.dequantize(lin.weight, lin.scales.astype(dtype), lin.biases.astype(dtype), 32, 4).astype(mx.float32)
        assert mx.array_equal(weights[name], want.T if name == "down" else want), name
    ref, _ = load_resident(path)
    budget = min_budget(fd, CONTEXT, kv_size_of(fd)) + int(0.5 * fd.ffn_bytes)
    model, _ = load(path, memory_budget=budget, sparsity="dense", context=CONTEXT)
    try:
        assert greedy(model) == greedy(ref)
    finally:
        model.flash.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_native_symmetric_rows_equal_stored_biases(bits):
    """row_dot / row_axpy / block_axpy with symmetric=True (no biases read) equal the same products with the
    biases -2^(bits-1) * scales stored."""
    rng = np.random.default_rng(1)
    k, n = 24, 128
    w = mx.array(rng.integers(0, 2**32, (k, n * bits // 32), dtype=np.uint64).astype(np.uint32))
    s = mx.array(rng.standard_normal((k, n // 32)).astype(np.float16))
    b = symmetric_biases(s, bits)
    stored = cpu_gemv.QuantRows.of_matrix(w, s, b, 32, bits)
    sym = cpu_gemv.QuantRows.of_matrix(w, s, None, 32, bits)
    assert sym.symmetric and not stored.symmetric
    x, c = rng.standard_normal(n).astype(np.float32), rng.standard_normal(k).astype(np.float32)
    assert np.allclose(cpu_gemv.row_dot(x, sym, k=k), cpu_gemv.row_dot(x, stored, k=k), rtol=1e-5, atol=1e-4)
    assert np.allclose(cpu_gemv.row_axpy(c, sym), cpu_gemv.row_axpy(c, stored), rtol=1e-5, atol=1e-4)
    blocks = np.arange(k, dtype=np.int32) // 8
    tables = mx.array(rng.standard_normal((3, n)).astype(np.float16))
    args = (c, w, 0, n * bits // 8, None, blocks)
    assert np.allclose(
        cpu_gemv.block_axpy(*args, tables, None, n, bits),
        cpu_gemv.block_axpy(*args, tables, symmetric_biases(tables, bits), n, bits),
        rtol=1e-5,
        atol=1e-4,
    )


@pytest.mark.parametrize("kernels", [pytest.param("native", marks=pytest.mark.native), "mlx"])
@pytest.mark.parametrize("budget", ["floor", "resident"])
def test_symmetric_resident_modules_keep_no_biases(tmp_path, monkeypatch, request, budget, kernels):
    """A Q4_0 GGUF's attention projections and embedding keep their codes and scales only (format v4): no
    biases on disk, none in the model's memory, none streamed below the resident floor; their weights are the
    GGUF's exactly and the tokens and bytes read those of the same conversion with the biases stored, less them.
    kernels "mlx": MLX's ops derive the biases (the path Metal takes), else the native kernels read none."""
    if kernels == "mlx":
        request.getfixturevalue("mlx_ops")
    from mlx_flash.budget import min_streaming_budget
    from mlx_flash.convert.source import load_source_model, resolve_source
    from mlx_flash.engine.resident import stream_groups
    from mlx_flash.format import directory as flash_format
    from mlx_flash.generate import generate_step as flash_generate_step
    from mlx_flash.loader import cpu_cast
    from mlx_flash.models.inspect import instantiate
    from mlx_flash.tools.synthetic_gguf import write_gguf

    from mlx.utils import tree_flatten

    gguf = write_gguf("tiny", tmp_path / "tiny.gguf", progress=False, vocab_size=4096)  # large enough to stream
    path = convert(str(gguf), tmp_path / "flash", alignment=512, progress=False)
    with monkeypatch.context() as m:  # the same conversion as format v3 wrote it: biases stored
        m.setattr(flash_format, "_implied_bits", lambda *args: None)
        stored = convert(str(gguf), tmp_path / "stored", alignment=512, progress=False)
    fd, fd_stored = FlashDir(path), FlashDir(stored)
    src, _ = load_source_model(resolve_source(str(gguf), tmp_path))
    quantised = {
        p
        for p, m in src.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and ".mlp." not in p
    }
    assert set(fd.symmetric) == quantised and set(fd.symmetric.values()) == {4} and fd_stored.symmetric == {}
    assert not any(k.endswith(".biases") for k in fd.resident_index())
    want = dict(tree_flatten(src.parameters()))
    for k, v in fd.load_resident().items():
        if ".mlp." not in k:
            assert mx.array_equal(v, want[k]), k

    def run(p):
        f = FlashDir(p)
        if budget == "floor":  # attention layers and the tied embedding streamed: every one of them each token
            cap = min_streaming_budget(
                f,
                CONTEXT,
                kv_size_of(f),
                resident=f.resident_nbytes(cpu_cast),
                groups=stream_groups(f, instantiate(f.config), cpu_cast, CONTEXT),
            )
        else:
            cap = min_budget(f, CONTEXT, kv_size_of(f)) + f.ffn_bytes
        model, _ = load(p, memory_budget=cap, sparsity="dense", context=CONTEXT)
        try:
            assert len(model.flash.plan.streamed) == (0 if budget == "resident" else 6)  # 4 layers, embedding, head
            params = [k for k, _ in tree_flatten(model.parameters()) if k.endswith(".biases")]
            assert model.forward.native == (kernels == "native"), model.forward.why
            # the native decode step (mlx_flash's loop) and the model's layers (mlx-lm's loop)
            tokens = [
                [int(t) for t, _ in steps(mx.array(PROMPT), model, max_tokens=24)]
                for steps in (flash_generate_step, generate_step)
            ]
            model.flash.stats.end()
            return params, tokens, model.flash.stats.decode_tokens()[-1].streamed_bytes
        finally:
            model.flash.close()

    params, tokens, streamed = run(path)
    params_stored, tokens_stored, streamed_stored = run(stored)
    assert tokens == tokens_stored and tokens[0] == tokens[1]
    if budget == "floor":  # a token reads every streamed layer's and the head's biases less (the embedding: its rows')
        assert params == params_stored == []
        biases = {k: t.nbytes for k, t in fd_stored.resident_index().items() if k.endswith(".biases")}
        whole = sum(n for k, n in biases.items() if "embed_tokens" not in k)
        assert whole <= streamed_stored - streamed <= sum(biases.values()), (streamed, streamed_stored, whole)
    else:
        assert params == [] and len(params_stored) == len(quantised)
        assert streamed == streamed_stored == 0
