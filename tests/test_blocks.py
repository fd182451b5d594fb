"""Resident matrices kept as GGML blocks (compute/blocks.py): their products on every path against the gguf
package's dequantised weights, a large matrix in chunks as one call, the native attention's block
handles, and what only linear layers and embeddings may hold."""

from mlx_flash.compute import blocks, cpu_gemv
from mlx_flash.format.ggml import BLOCKS, random_rows

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_gather_ffn import CXX, STUBS

KINDS = list(BLOCKS)


def reference(x: np.ndarray, raw: np.ndarray, kind: str) -> np.ndarray:
    w = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float64)
    return x.astype(np.float64) @ w.T


def relative(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.fixture
def mlx_ops(monkeypatch):
    """MLX's ops for every product (what a Mac's GPU computes)."""
    monkeypatch.setattr(cpu_gemv, "enabled", False)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_products_are_the_dequantised_matrix(kind, rows, mlx_ops):
    rng = np.random.default_rng(rows)
    raw = random_rows(rng, kind, 48, 512)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    y = blocks.matmul(mx.array(x), mx.array(raw), kind)
    assert y.shape == (rows, 48) and y.dtype == mx.float32
    assert relative(y, reference(x, raw, kind)) < 1e-5


@pytest.mark.native
@pytest.mark.parametrize("kind", KINDS)
def test_native_products_are_the_dequantised_matrix(kind, float_activations):
    """A few float32 rows on the CPU: `cpu_gemv.block_dot` (float activations here: the reference's arithmetic), the
    decode step's handle (`BlockRows.dot`) the same bits."""
    rng = np.random.default_rng(2)
    raw = random_rows(rng, kind, 48, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    layer = blocks.keep_blocks(nn.Linear(512, 48, bias=False), kind)
    layer.weight = mx.array(raw)
    y = layer(mx.array(x))
    assert relative(y, reference(x, raw, kind)) < 1e-5
    assert np.array_equal(np.array(y), blocks.handle(layer)[1].dot(x))


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K"])
def test_a_large_matrix_in_chunks_is_one_call(kind, mlx_ops, monkeypatch):
    """Chunks of rows (temporaries over CHUNK_BYTES: an LM head) give the product of one call (up to the float
    product's own order of sums, which depends on its width: CHUNK_BYTES is fixed, so every budget has the same)."""
    rng = np.random.default_rng(3)
    w, x = mx.array(random_rows(rng, kind, 200, 256)), mx.array(rng.standard_normal((2, 256)).astype(np.float32))
    whole = blocks.matmul(x, w, kind)
    monkeypatch.setattr(blocks, "CHUNK_BYTES", 64 << 10)  # (chunks of 34 or 146 rows)
    chunked = blocks.matmul(x, w, kind)
    assert relative(chunked, np.array(whole, np.float64)) < 1e-6


def test_an_embedding_looks_up_and_computes_as_a_head(mlx_ops):
    rng = np.random.default_rng(4)
    raw = random_rows(rng, "Q6_K", 64, 256)
    table = blocks.keep_blocks(nn.Embedding(64, 256), "Q6_K")
    assert table["weight"].shape == (64, 210) and table["weight"].dtype == mx.uint8
    table.weight = mx.array(raw)
    ids = mx.array([[3, 63, 3]])
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    assert np.array_equal(np.array(table(ids))[0], want[[3, 63, 3]])
    x = rng.standard_normal((1, 256)).astype(np.float32)
    assert relative(table.as_linear(mx.array(x)), reference(x, raw, "Q6_K")) < 1e-5


def test_only_linear_layers_and_embeddings_hold_blocks():
    with pytest.raises(TypeError, match="RMSNorm"):
        blocks.keep_blocks(nn.RMSNorm(256), "Q6_K")
    with pytest.raises(ValueError, match="not a GGML block type"):
        blocks.keep_blocks(nn.Linear(256, 8), "Q7_K")
    with pytest.raises(ValueError, match="multiples of 256"):
        blocks.keep_blocks(nn.Linear(100, 8), "Q6_K")


def attention_reference(x, ws, heads, hd, inv, eps=1e-5):
    """A llama attention block (norm weights 1, RoPE on halves, causal, one sequence from position 0) in float64."""
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    q, k, v = (h @ ws[n].T for n in ("q_proj", "k_proj", "v_proj"))
    q, k, v = (a.reshape(len(x), heads, hd).transpose(1, 0, 2) for a in (q, k, v))
    angles = np.arange(len(x))[:, None] * inv[None].astype(np.float64)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope(a):
        a1, a2 = a[..., : hd // 2], a[..., hd // 2 :]
        return np.concatenate([a1 * cos - a2 * sin, a1 * sin + a2 * cos], axis=-1)

    scores = rope(q) @ rope(k).transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((len(x), len(x)), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    att = (p / p.sum(-1, keepdims=True)) @ v
    return x + att.transpose(1, 0, 2).reshape(len(x), -1) @ ws["o_proj"].T


@pytest.mark.native
def test_the_native_attention_takes_block_handles(float_activations):
    """The native attention block (kernels/cpu_gemv.c) with q, k, v, o of four GGML types: a float64 attention of
    their dequantised matrices."""
    from mlx_flash.engine.native_step import _handle

    rng = np.random.default_rng(5)
    d, heads, hd = 256, 2, 128
    kinds = {"q_proj": "Q6_K", "k_proj": "Q4_K", "v_proj": "Q2_K", "o_proj": "IQ4_XS"}
    handles, ws = [], {}
    for name, kind in kinds.items():
        raw = random_rows(rng, kind, d, 256, scale=0.5)
        layer = blocks.keep_blocks(nn.Linear(256, d, bias=False), kind)
        layer.weight = mx.array(raw)
        handles.append(_handle(layer)[0])
        ws[name] = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float64)
    x = rng.standard_normal((3, d)).astype(np.float32)
    want = attention_reference(x.astype(np.float64), ws, heads, hd, (10000.0 ** (-np.arange(0, hd, 2) / hd)))
    h, ones = np.empty_like(x), np.ones(d, np.float32)
    kc, vc = np.zeros((heads, 8, hd), np.float32), np.zeros((heads, 8, hd), np.float32)
    inv = (10000.0 ** (-np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    cpu_gemv.attention(x, h, ones, ones, 1e-5, *handles, kc, vc, 0, 8, heads, heads, hd, inv, False, 1.0, hd**-0.5)
    assert relative(x, want) < 1e-4


# Stand-ins for the Metal builtins kernels/ggml_blocks.metal uses beyond those of gather_ffn.metal's (test_gather_ffn)
BLOCK_STUBS = r"""
typedef unsigned short ushort;
typedef _Float16 half;
template <typename T, typename U> T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U));
    T t;
    std::memcpy(&t, &u, sizeof t);
    return t;
}
#define thread
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_metal_kernel_emulated_on_cpu(tmp_path):
    """The Metal kernel's body (kernels/ggml_blocks.metal) compiled as C++ with stubbed builtins and run on CPU
    threads (simd_sum emulated), for every block type: the dequantised matrix's product. This checks its block
    layouts, indexing and reductions, not the Metal compiler or the GPU."""
    import ctypes
    import subprocess
    import textwrap

    src = blocks.KERNEL_SOURCES
    k, n, rows = 40, 1280, 3  # (40 sub-blocks of 32 a row: lanes take more than one)
    pieces = [STUBS, BLOCK_STUBS, src["header"]]
    for kind, code in cpu_gemv.GGML_KINDS.items():
        values, nbytes = BLOCKS[kind]
        consts = dict(KIND=code, N=n, RB=n // values * nbytes, VALUES=values, BB=nbytes)
        pieces.append(f"""
namespace k_{kind} {{
{chr(10).join(f"constexpr int {c} = {v};" for c, v in consts.items())}
typedef float TO;
void kernel(const float* x, const uint8_t* w, const int* w_shape, float* out, uint3 thread_position_in_grid,
            uint3 thread_position_in_threadgroup, uint thread_index_in_simdgroup) {{
{textwrap.indent(src["block_dot"], "    ")}
}}
}}
extern "C" void block_dot_{kind}(const float* x, const uint8_t* w, int k, int B, float* out) {{
    int w_shape[2] = {{k, k_{kind}::RB}};
    dispatch({{32 * uint(k), uint(B), 1}}, {{256, 1, 1}}, [&](uint3 g, uint3 l, uint lane) {{
        k_{kind}::kernel(x, w, w_shape, out, g, l, lane);
    }});
}}""")
    cpp, lib = tmp_path / "ggml_blocks.cpp", tmp_path / "ggml_blocks.so"
    cpp.write_text("\n".join(pieces))
    r = subprocess.run(
        [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wall", "-o", str(lib), str(cpp)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    so = ctypes.CDLL(str(lib))
    rng = np.random.default_rng(6)
    for kind in cpu_gemv.GGML_KINDS:
        raw = np.ascontiguousarray(random_rows(rng, kind, k, n))
        x = rng.standard_normal((rows, n)).astype(np.float32)
        out = np.full((rows, k), np.nan, dtype=np.float32)
        getattr(so, f"block_dot_{kind}")(
            x.ctypes.data_as(ctypes.c_void_p),
            raw.ctypes.data_as(ctypes.c_void_p),
            k,
            rows,
            out.ctypes.data_as(ctypes.c_void_p),
        )
        assert relative(out, reference(x, raw, kind)) < 1e-5, kind
