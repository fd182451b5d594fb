"""GGML blocks as stored (format/ggml.py, kernels/cpu_gemv.c block_dot): MLX's dequantisation against the gguf
package's bit for bit, the native products against it (float activations) and against llama.cpp's activation
quantisation (int8), the AVX2 loops against the scalar ones, and bad input refused."""

from mlx_flash.compute import cpu_gemv
from mlx_flash.format.ggml import BLOCKS, D_AT, dequantize, random_rows, row_bytes

import gguf
import mlx.core as mx
import numpy as np
import pytest

KINDS = list(BLOCKS)


def random_blocks(rng, kind, rows, n):
    """Any bytes, with finite float16 scales: every code, scale and min a block can hold."""
    values, nbytes = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, n // values, nbytes), dtype=np.uint8)
    d = rng.standard_normal((rows, n // values, 2)).astype(np.float16).view(np.uint8)
    at = D_AT.get(kind, 0)
    raw[..., at : at + 2] = d[..., :2]
    if kind in ("Q4_K", "Q5_K", "Q2_K"):  # (dmin)
        raw[..., at + 2 : at + 4] = d[..., 2:4]
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_bit_for_bit(kind):
    raw = random_blocks(np.random.default_rng(0), kind, 5, 3 * BLOCKS[kind][0] * (8 if kind[-1] == "0" else 1))
    ours = np.array(dequantize(mx.array(raw), kind))
    theirs = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert dequantize(mx.array(raw.reshape(5, 1, -1)), kind).shape == (5, 1, ours.shape[-1])  # leading dims kept
    assert row_bytes(kind, ours.shape[-1]) == raw.shape[1]
    with pytest.raises(ValueError, match="multiples"):
        row_bytes(kind, BLOCKS[kind][0] + 1)


@pytest.mark.parametrize("kind", KINDS)
def test_random_rows_have_the_asked_scale(kind):
    rng = np.random.default_rng(1)
    w = np.array(dequantize(mx.array(random_rows(rng, kind, 128, 1024, scale=2.0, zero_mean=True)), kind))
    out = w @ rng.standard_normal(1024)
    assert 1.6 < out.std() < 2.4 and abs(w.mean()) < 0.05 * w.std()


def activations(kind, x):
    """x as llama.cpp quantises it for `kind`'s dot (Q8_0: per 32, a float16 scale; Q8_K: per 256), in float64."""
    n = x.shape[-1]
    if BLOCKS[kind][0] == 32:
        b = x.reshape(*x.shape[:-1], n // 32, 32)
        d = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
        q = np.round(b * np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32))
        return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)
    b = x.reshape(*x.shape[:-1], n // 256, 256)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    iscale = np.where(big != 0, np.float32(-127) / np.where(big != 0, big, 1), 0).astype(np.float32)
    q = np.minimum(127, np.rint((iscale * b).astype(np.float32)))
    return (q * np.where(iscale != 0, 1 / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)).reshape(x.shape)


@pytest.fixture(params=["simd", "scalar"])
def loops(request):
    cpu_gemv._native.set_simd(request.param == "simd")
    yield request.param
    cpu_gemv._native.set_simd(True)


@pytest.mark.native
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float"])
@pytest.mark.parametrize("kind", KINDS)
def test_block_dot_against_the_dequantised_rows(kind, int8, loops):
    """Rows in slots of a cache-like buffer, two matrices a row (a unit's gate and up), three positions: each
    output is x . the dequantised row (int8: llama.cpp's quantised x) on either loops (float activations: the same
    bits), and a position computed alone gives its bits in a pass of several."""
    rng = np.random.default_rng(2)
    n, k, m = 512 if BLOCKS[kind][0] == 256 else 17 * 32, 24, 3  # (an odd number of 32-value blocks)
    nb = row_bytes(kind, n)
    a, b = random_rows(rng, kind, 40, n), random_rows(rng, kind, 40, n)
    stride = 2 * nb + 64
    buf = np.zeros((40, stride), np.uint8)
    buf[:, 16 : 16 + nb], buf[:, 16 + nb : 16 + 2 * nb] = a, b
    slots = rng.permutation(40)[:k].astype(np.int32)
    x = rng.standard_normal((m, n)).astype(np.float32)
    cpu_gemv.set_int8_activations(int8)
    try:
        got = cpu_gemv.block_dot(x, buf, (16, 16 + nb), stride, kind, n, slots=slots)
        one = cpu_gemv.block_dot(x[1], buf, (16,), stride, kind, n, slots=slots)
        cpu_gemv._native.set_simd(loops != "simd")
        other = cpu_gemv.block_dot(x, buf, (16, 16 + nb), stride, kind, n, slots=slots)
    finally:
        cpu_gemv.set_int8_activations(True)
    assert got.shape == (m, k, 2)
    xs = activations(kind, x.astype(np.float64)) if int8 else x.astype(np.float64)
    for t, rows in enumerate((a, b)):
        ref = xs @ np.array(dequantize(mx.array(rows[slots]), kind), np.float64).T
        np.testing.assert_allclose(got[..., t], ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    if not int8:  # (int8: the AVX2 loops sum in float lanes, as llama.cpp's; the scalar ones block by block)
        assert np.array_equal(got.view(np.uint32), other.view(np.uint32))
    np.testing.assert_allclose(other, got, rtol=0, atol=2e-5 * np.abs(got).max())
    assert one.shape == (k, 1) and np.array_equal(one[:, 0], got[1, :, 0])  # a position alone: its own bits


@pytest.mark.native
@pytest.mark.skipif(not cpu_gemv.info().get("avx512_cpu"), reason="the CPU lacks AVX-512 F/BW/VL/VNNI")
@pytest.mark.parametrize("kind", KINDS)
def test_avx512_loops_give_the_avx2_bits(kind):
    """int8 activations: the AVX-512 loops (Q4_K, Q5_K, Q6_K; the others' AVX2 ones) give the AVX2 loops' bits, one
    position or several, rows of one block (a dense FFN's down rows) or several."""
    rng = np.random.default_rng(4)
    for n in (BLOCKS[kind][0], 1536 if BLOCKS[kind][0] == 256 else 17 * 32):
        rows = random_rows(rng, kind, 33, n)
        x = (rng.standard_normal((5, n)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
        got = []
        try:
            for on in (True, False):
                cpu_gemv.set_avx512(on)
                assert cpu_gemv.info()["avx512"] == on
                got.append(cpu_gemv.block_dot(x, rows, (0,), rows.shape[1], kind, n, k=len(rows)))
        finally:
            cpu_gemv.set_avx512(True)
        assert np.array_equal(got[0].view(np.uint32), got[1].view(np.uint32))


@pytest.mark.native
def test_block_dot_refuses_bad_input():
    rng = np.random.default_rng(3)
    rows = random_rows(rng, "Q4_K", 4, 256)
    x = np.zeros(256, np.float32)
    with pytest.raises(IndexError, match="outside"):
        cpu_gemv.block_dot(x, rows, (0,), rows.shape[1], "Q4_K", 256, slots=np.array([4], np.int32))
    with pytest.raises(IndexError, match="negative"):
        cpu_gemv.block_dot(x, rows, (0,), rows.shape[1], "Q4_K", 256, slots=np.array([-1], np.int32))
    with pytest.raises(ValueError, match="bad shape"):
        cpu_gemv.block_dot(x[:100], rows, (0,), rows.shape[1], "Q4_K", 100, k=4)
    with pytest.raises(ValueError, match="expected float32"):
        cpu_gemv.block_dot(np.zeros(512, np.float32), rows, (0,), rows.shape[1], "Q4_K", 256, k=4)
    with pytest.raises(ValueError, match="1 to 4"):
        cpu_gemv.block_dot(x, rows, (), rows.shape[1], "Q4_K", 256, k=4)


@pytest.mark.native
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float"])
@pytest.mark.parametrize(
    "kinds",
    [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q2_K", "Q3_K"), ("IQ4_XS", "Q5_K"), ("Q4_0", "Q8_0"), ("IQ4_NL", "Q4_0")],
)
def test_expert_glu_is_block_dot_glu_block_dot(kinds, int8, loops):
    """A pass over several SwiGLU experts of GGML blocks (rows by address, in two buffers) gives each expert's
    block_dot of gate and up, glu_pairs and block_dot of down, bit for bit, for several positions; one expert alone
    gives its bits in a pass of several."""
    rng = np.random.default_rng(5)
    gu, down = kinds
    n, hidden, m, E = 512, 256 if BLOCKS[down][0] == 256 else 64, 3, 4
    gl, dl = row_bytes(gu, n), row_bytes(down, hidden)
    offs = (8, 8 + hidden * gl, 8 + 2 * hidden * gl)
    stride = offs[2] + n * dl + 24
    bufs = [np.zeros((3, stride), np.uint8) for _ in range(2)]
    for buf in bufs:
        for row in buf:
            row[offs[0] : offs[2]] = np.concatenate([random_rows(rng, gu, hidden, n).reshape(-1) for _ in range(2)])
            row[offs[2] : offs[2] + n * dl] = random_rows(rng, down, n, hidden).reshape(-1)
    at = [(bufs[e % 2], e // 2 + e % 2) for e in range(E)]  # (rows in either buffer)
    x = rng.standard_normal((m, n)).astype(np.float32)
    cpu_gemv.set_int8_activations(int8)
    try:
        got = cpu_gemv.expert_glu(x, [b.ctypes.data + s * stride for b, s in at], offs, hidden, n, gu, down)
        alone = cpu_gemv.expert_glu(x[1:2], [at[2][0].ctypes.data + at[2][1] * stride], offs, hidden, n, gu, down)
        want = []
        for b, s in at:
            pairs = cpu_gemv.block_dot(x, b, (s * stride + offs[0], s * stride + offs[1]), gl, gu, n, k=hidden)
            h = cpu_gemv.glu_pairs(pairs)
            want.append(cpu_gemv.block_dot(h, b, (s * stride + offs[2],), dl, down, hidden, k=n)[..., 0])
    finally:
        cpu_gemv.set_int8_activations(True)
    assert got.shape == (E, m, n)
    assert np.array_equal(got.view(np.uint32), np.stack(want).view(np.uint32))
    assert np.array_equal(alone[0, 0].view(np.uint32), got[2, 1].view(np.uint32))
