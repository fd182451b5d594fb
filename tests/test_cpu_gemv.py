"""cpu_gemv: the native CPU matvecs against MLX's quantized_matmul, the model patch, bad input, and the AVX-512 loops
against the AVX2 / VNNI ones."""

import os
import subprocess
import sys

from mlx_flash.compute import cpu_gemv

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = [
    pytest.mark.native,
    pytest.mark.usefixtures("float_activations"),
]  # int8 activations: tests/test_decode.py


@pytest.fixture(params=["simd", "scalar"], autouse=True)
def loops(request):
    cpu_gemv._native.set_simd(request.param == "simd")
    yield request.param
    cpu_gemv._native.set_simd(True)


def quantized(rng, rows, n, bits, group_size, scale_dtype):
    w = mx.array(rng.standard_normal((rows, n)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    mx.eval(wq, s, b)
    return wq, s, b


def reference(x, wq, s, b, group_size, bits, transpose):
    """MLX's own op, in float32 (the scales cast up: MLX needs them in x's dtype)."""
    return mx.quantized_matmul(
        x, wq, s.astype(mx.float32), b.astype(mx.float32), transpose=transpose, group_size=group_size, bits=bits
    )


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_matvec_equals_quantized_matmul(bits, group_size, scale_dtype):
    rng = np.random.default_rng(bits * group_size)
    rows, n = 300, 384  # rows not a multiple of the thread split
    wq, s, b = quantized(rng, rows, n, bits, group_size, scale_dtype)
    x = mx.array(rng.standard_normal((1, 1, n)).astype(np.float32))
    y = cpu_gemv.matvec(x, wq, s, b, group_size, bits, transpose=True)
    assert y.shape == (1, 1, rows)
    assert np.allclose(y, reference(x, wq, s, b, group_size, bits, True), rtol=1e-4, atol=1e-3)
    c = mx.array(rng.standard_normal((1, rows)).astype(np.float32))
    y = cpu_gemv.matvec(c, wq, s, b, group_size, bits, transpose=False)
    assert y.shape == (1, n)
    assert np.allclose(y, reference(c, wq, s, b, group_size, bits, False), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, group_size", [(256, 64), (288, 32), (320, 32)])
@pytest.mark.parametrize("avx512", [True, False])
def test_several_positions_equal_one_at_a_time(bits, int8, n, group_size, avx512):
    """x [m, n] / c [m, k]: each position's output is bit for bit the single-position product (m = 11 crosses
    a tile of positions and the kernels' groups of positions; n's blocks end in a pair or a single one past the
    kernels' groups of four; the AVX-512 loops and the AVX2 / VNNI ones), rows read once for all."""
    cpu_gemv.set_avx512(avx512)
    try:
        _several_positions(bits, int8, n, group_size)
    finally:
        cpu_gemv.set_avx512(True)


def _several_positions(bits, int8, n, group_size):
    rng = np.random.default_rng(bits)
    wq, s, b = quantized(rng, 70, n, bits, group_size, mx.float16)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, group_size, bits)
    slots = rng.permutation(70)[:40].astype(np.int32)
    x = rng.standard_normal((11, n)).astype(np.float32)
    c = rng.standard_normal((11, 40)).astype(np.float32)
    c[:, 3] = 0.0  # a row no position uses
    c[4, 5] = 0.0  # a row one position does not
    cpu_gemv.set_int8_activations(int8)
    try:
        assert np.array_equal(cpu_gemv.row_dot(x, q, slots), np.stack([cpu_gemv.row_dot(v, q, slots) for v in x]))
    finally:
        cpu_gemv.set_int8_activations(True)
    assert np.array_equal(cpu_gemv.row_axpy(c, q, slots), np.stack([cpu_gemv.row_axpy(v, q, slots) for v in c]))
    blocks = np.sort(rng.integers(0, 3, 40)).astype(np.int32)
    S = mx.array(rng.uniform(0.5, 1.5, (3, n)).astype(np.float16))
    got = cpu_gemv.block_axpy(c, wq, 0, wq.shape[1] * 4, slots, blocks, S, None, n, bits)
    assert np.array_equal(
        got, np.stack([cpu_gemv.block_axpy(v, wq, 0, wq.shape[1] * 4, slots, blocks, S, None, n, bits) for v in c])
    )
    with pytest.raises(ValueError, match=r"\[m, "):  # not a whole number of positions
        cpu_gemv._native.row_dot(x.reshape(-1)[: n + 44], np.empty(40, np.float32), *q._args(slots, 40))


def test_slots_pick_rows_in_any_order():
    rng = np.random.default_rng(1)
    wq, s, b = quantized(rng, 50, 128, 4, 64, mx.float16)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, 64, 4)
    x = rng.standard_normal(128).astype(np.float32)
    full = cpu_gemv.row_dot(x, q, k=50)
    slots = np.array([49, 3, 3, 0, 17], dtype=np.int32)
    assert np.array_equal(cpu_gemv.row_dot(x, q, slots), full[slots])  # same arithmetic per row: bitwise
    c = rng.standard_normal(5).astype(np.float32)
    dense_c = np.zeros(50, dtype=np.float32)
    np.add.at(dense_c, slots, c)
    assert np.allclose(cpu_gemv.row_axpy(c, q, slots), cpu_gemv.row_axpy(dense_c, q), rtol=1e-5, atol=1e-5)


def unit_rows(rng, rows, n, bits, group_size):
    """Two matrices' rows side by side in one buffer, as a neuron cache holds a GLU's gate and up per unit:
    (buffer, QuantRows of the first, of the second)."""
    mats = [quantized(rng, rows, n, bits, group_size, mx.float16) for _ in range(2)]
    parts = [np.array(a).view(np.uint8).reshape(rows, -1) for i in range(3) for a in (mats[0][i], mats[1][i])]
    buf = np.ascontiguousarray(np.concatenate(parts, 1))
    at = np.cumsum([0] + [p.shape[1] for p in parts])
    stride = buf.shape[1]
    return [
        cpu_gemv.QuantRows(
            buf, int(at[i]), stride, buf, int(at[2 + i]), stride, buf, int(at[4 + i]), stride, n, bits, group_size,
            mx.float16,
        )
        for i in (0, 1)
    ]  # fmt: skip


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_row_dot_pairs_is_each_matrix_alone(bits, int8):
    """A GLU's gate and up rows of each unit in one pass (row_dot_pairs): every result the bits of its own row_dot,
    and glu_pairs silu_mul's; rows by slots, several positions."""
    rng = np.random.default_rng(bits)
    gate, up = unit_rows(rng, 40, 256, bits, 32)
    slots = rng.permutation(40)[:25].astype(np.int32)
    cpu_gemv.set_int8_activations(int8)
    try:
        for m in (1, 3):
            x = rng.standard_normal((m, 256)).astype(np.float32)
            gu = cpu_gemv.row_dot_pairs(x, gate, up, slots)
            g, u = cpu_gemv.row_dot(x, gate, slots), cpu_gemv.row_dot(x, up, slots)
            assert np.array_equal(gu[..., 0], g) and np.array_equal(gu[..., 1], u)
            cpu_gemv.silu_mul(g.reshape(-1), u.reshape(-1))
            assert np.array_equal(cpu_gemv.glu_pairs(gu), g)
    finally:
        cpu_gemv.set_int8_activations(False)
    other = cpu_gemv.QuantRows.of_matrix(*quantized(rng, 40, 256, bits, 32, mx.float16), 32, bits)
    with pytest.raises(ValueError, match="same rows"):
        cpu_gemv.row_dot_pairs(x, gate, other, slots)
    with pytest.raises(IndexError, match="outside"):  # the second rows checked against the buffer too
        cpu_gemv._native.row_dot_pairs(10**6, 0, 0, x, np.empty((m, 50), np.float32), *gate._args(slots, 25))


def test_sum_rows_adds_in_row_order():
    """sum_rows: the bits of a Python loop of numpy additions (partial sums of very different sizes, where any
    other order would round differently), for one row or several positions a row (a prompt pass's, summed in pieces
    of columns across threads, the last one short); shapes that do not divide fail."""
    rng = np.random.default_rng(3)
    for shape in ((43, 1, 4096), (43, 16, 4100), (5, 3, 7), (1, 9), (200, 2)):
        a = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, (shape[0],) + (1,) * (len(shape) - 1))
        a = a.astype(np.float32)
        want = a[0]
        for part in a[1:]:
            want = want + part
        assert np.array_equal(cpu_gemv.sum_rows(a), want)
    if shape[0] > 2:
        assert not np.array_equal(cpu_gemv.sum_rows(a[::-1]), want)  # (the order shows in the bits)
    with pytest.raises(ValueError, match="whole rows"):
        cpu_gemv._native.sum_rows(np.zeros(10, np.float32), np.zeros(3, np.float32))


def test_rows_outside_the_buffers_raise():
    rng = np.random.default_rng(2)
    wq, s, b = quantized(rng, 8, 64, 4, 32, mx.float32)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, 32, 4)
    x = np.ones(64, dtype=np.float32)
    with pytest.raises(IndexError, match="outside"):
        cpu_gemv.row_dot(x, q, np.array([0, 8], dtype=np.int32))
    with pytest.raises(IndexError, match="negative"):
        cpu_gemv.row_dot(x, q, np.array([-1], dtype=np.int32))
    with pytest.raises(IndexError, match="outside"):
        cpu_gemv.row_dot(x, q, k=9)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemv.row_dot(np.ones(63, dtype=np.float32), q, k=8)
    with pytest.raises(ValueError, match="bits"):
        cpu_gemv._native.row_dot(x, np.empty(8, np.float32), wq, 0, 32, s, 0, 8, b, 0, 8, None, 8, 64, 3, 32, 2)
    strided = mx.concatenate([wq, wq], axis=1)[:, : wq.shape[1]]  # a column slice: a strided view
    with pytest.raises(ValueError, match="not C-contiguous"):
        cpu_gemv._native.row_dot(x, np.empty(8, np.float32), strided, 0, 32, s, 0, 8, b, 0, 8, None, 8, 64, 4, 32, 2)
    assert cpu_gemv.matvec(mx.array(x)[None], strided, s, b, 32, 4) is None  # MLX's op takes it instead
    with pytest.raises(ValueError, match="bad shape"):
        cpu_gemv._native.row_dot(x, np.empty(8, np.float32), wq, 0, 32, s, 0, 8, b, 0, 8, None, 8, 64, 4, 48, 2)


def test_patch_switches_decode_to_the_native_kernels():
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(128, 96), nn.Embedding(40, 128))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    lin, emb = model.layers
    x1 = mx.array(rng.standard_normal((1, 1, 128)).astype(np.float32))
    x5 = mx.array(rng.standard_normal((1, 5, 128)).astype(np.float32))
    before = [lin(x1), lin(x5), emb.as_linear(x1)]
    cpu_gemv.patch(model)
    assert type(lin) is cpu_gemv.QuantizedLinear and type(emb) is cpu_gemv.QuantizedEmbedding
    after = [lin(x1), lin(x5), emb.as_linear(x1)]
    assert np.allclose(after[0], before[0], rtol=1e-4, atol=1e-4)  # bias included
    assert np.allclose(after[1], before[1], rtol=1e-4, atol=1e-4)  # several rows: natively too, each row's bits
    assert np.array_equal(after[1][0, 2], lin(x5[:, 2:3])[0, 0])  # as its own product
    assert np.allclose(after[2], before[2], rtol=1e-4, atol=1e-4)
    cpu_gemv.enabled = False
    try:
        assert np.array_equal(lin(x1), before[0])  # switched off: MLX's op again
    finally:
        cpu_gemv.enabled = True


@pytest.mark.parametrize("transpose", [True, False])
def test_several_rows_dequantise_in_chunks(monkeypatch, transpose):
    """Prompts: more float32 rows than NATIVE_ROWS against quantised weights, dequantised a few rows at a time (chunks
    forced small here) and multiplied in float32, equal MLX's quantized_matmul to float tolerance."""
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((96, 128)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.array(rng.standard_normal((2, 20, 128 if transpose else 96)).astype(np.float32))
    want = mx.quantized_matmul(x, q, s, b, transpose=transpose, group_size=32, bits=4)
    monkeypatch.setattr(cpu_gemv, "DEQUANT_CHUNK_BYTES", 10 * 128 * 4)  # 10 rows a chunk: 10 chunks
    calls = []
    dequantize = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or dequantize(*a, **k))
    got = cpu_gemv.quantized_matmul(x, q, s, b, 32, 4, transpose=transpose)
    assert len(calls) == 10 and got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-4, atol=1e-3)


def test_an_untied_head_leaves_prompt_logits_lazy(monkeypatch):
    """The LM head's prompt logits, which mlx-lm discards, are not computed by the prompt path's evaluations."""
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(64, 64), nn.Linear(64, 96)
    nn.quantize(model, group_size=32, bits=4)
    cpu_gemv.patch(model)
    assert type(model.lm_head) is cpu_gemv.QuantizedHead and type(model.proj) is cpu_gemv.QuantizedLinear
    calls = []
    dequantize = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or dequantize(*a, **k))
    x = mx.array(np.random.default_rng(0).standard_normal((1, 40, 64)).astype(np.float32))  # > NATIVE_ROWS
    model.lm_head(model.proj(x))
    assert len(calls) == 1  # the projection's prompt path dequantised; the head's matmul stays lazy


# -- the AVX-512 loops against the AVX2 / VNNI ones: the same bits ---------------------------------------------

AVX512_CPU = bool(cpu_gemv.info().get("avx512_cpu"))
# n in blocks of 32: quads, a last pair, an unpaired block; groups past the last 8 (1-7, 4-7 among them)
N_BLOCKS = [1, 2, 3, 5, 6, 7, 12, 20, 22, 36, 80, 128]
SCALE_TYPES = [mx.float16, mx.bfloat16, mx.float32]


@pytest.fixture
def both_paths(loops):
    """f -> (f() with the AVX-512 loops, f() with the AVX2 / VNNI ones), checking which ran."""
    if loops == "scalar":
        pytest.skip("compares the SIMD loops")
    if not AVX512_CPU:
        pytest.skip("the CPU lacks AVX-512 F/BW/VL/VNNI")

    def run(f):
        out = []
        try:
            for on in (True, False):
                cpu_gemv.set_avx512(on)
                assert cpu_gemv.info()["avx512"] == on
                out.append(f())
        finally:
            cpu_gemv.set_avx512(True)
        return out

    return run


def shapes(group_size, seed):
    """(n, scale dtype, symmetric) for every n in N_BLOCKS that holds whole groups, the scale types and biases
    cycled."""
    ns = [32 * b for b in N_BLOCKS if (32 * b) % group_size == 0]
    return [(n, SCALE_TYPES[(i + seed) % 3], (i + seed) % 2 == 1) for i, n in enumerate(ns)]


def assert_same(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got, want), f"{what}: {np.count_nonzero(got != want)} of {got.size} differ"


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_avx512_row_dot_has_the_vnni_bits(both_paths, bits, group_size, m):
    """int8 activations (decoding's row_dot): four rows at a time in 512-bit VNNI, each the VNNI loop's result bit for
    bit; k = 37 rows (not a multiple of 4), rows picked by slots, a few outliers in x kept in float."""
    if bits == 8 and not cpu_gemv.info().get("vnni"):
        pytest.skip("without AVX-VNNI, 8-bit rows take float activations off AVX-512")
    rng = np.random.default_rng(bits * group_size + m)
    for n, scale_dtype, symmetric in shapes(group_size, m):
        wq, s, b = quantized(rng, 50, n, bits, group_size, scale_dtype)
        q = cpu_gemv.QuantRows.of_matrix(wq, s, None if symmetric else b, group_size, bits)
        slots = rng.integers(0, 50, 37).astype(np.int32)
        x = rng.standard_normal((m, n)).astype(np.float32)
        x[0, rng.integers(0, n)] = 50.0  # an outlier
        cpu_gemv.set_int8_activations(True)
        try:
            fast, ref = both_paths(lambda: cpu_gemv.row_dot(x, q, slots))
        finally:
            cpu_gemv.set_int8_activations(False)
        assert_same(fast, ref, f"row_dot n={n} {scale_dtype} symmetric={symmetric}")


def _at_the_limit(x, j, above):
    """x with x[j] at find_outliers' limit (6 rms, from the float sum of squares in order, x[j]'s own among them), or
    the least float above it"""
    x = x.copy()

    def limit(v):
        x[j] = v
        return np.float32(6) * np.sqrt(np.cumsum(x * x, dtype=np.float32)[-1] / np.float32(x.size))

    rest = np.sum(np.delete(x, j).astype(np.float64) ** 2)
    v = np.float32(np.sqrt(36 * rest / (x.size - 36)))  # the fixed point, then the floats about it
    for v in np.nextafter(v, np.float32(np.inf)) + np.arange(-64, 64, dtype=np.float32) * np.spacing(v):
        if (v > limit(v)) if above else (v == limit(v)):
            x[j] = v
            return x
    raise AssertionError("no float at the limit")


@pytest.mark.parametrize("bits", [4, 8])
def test_avx512_activations_are_rounded_as_the_loop_rounds_them(both_paths, bits):
    """int8 activations quantised in 512 bits (each block's step, values and sum; the outliers above the limit picked
    from a double sum of squares, or from the float one in order where an element lies near the limit) have the
    AVX2 loops' bits: elements at the limit or a float step above it, more outliers than are kept, zero and tiny
    blocks."""
    if bits == 8 and not cpu_gemv.info().get("vnni"):
        pytest.skip("without AVX-VNNI, 8-bit rows take float activations off AVX-512")
    rng = np.random.default_rng(bits)
    n = 1024
    wq, s, b = quantized(rng, 8, n, bits, 32, mx.float16)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, 32, bits)
    xs = []
    for _ in range(16):
        x = rng.standard_normal(n).astype(np.float32)
        xs += [_at_the_limit(x, rng.integers(n), above) for above in (False, True)]
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.choice(n, 12, replace=False)] = rng.uniform(30, 100, 12) * rng.choice([-1, 1], 12)
    x[64:96], x[96:128], x[130] = 0.0, 1e-30, 1e-38
    xs.append(x)
    cpu_gemv.set_int8_activations(True)
    try:
        for i, x in enumerate(xs):
            fast, ref = both_paths(lambda: cpu_gemv.row_dot(x, q, k=8))
            assert_same(fast, ref, f"x {i}")
    finally:
        cpu_gemv.set_int8_activations(False)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_avx512_row_axpy_has_the_avx2_bits(both_paths, bits, group_size, m):
    """row_axpy: each output element's FMAs in the AVX2 loop's order, with zero coefficients skipped, partial sums
    (dst), rows by slots."""
    rng = np.random.default_rng(100 + bits * group_size + m)
    for n, scale_dtype, symmetric in shapes(group_size, m):
        k = 45
        wq, s, b = quantized(rng, 60, n, bits, group_size, scale_dtype)
        q = cpu_gemv.QuantRows.of_matrix(wq, s, None if symmetric else b, group_size, bits)
        slots = rng.permutation(60)[:k].astype(np.int32)
        c = rng.standard_normal((m, k)).astype(np.float32)
        c[:, 3] = 0.0  # a row no position uses
        c[0, 7] = 0.0  # a row one position does not
        dst = np.sort(rng.integers(0, 3, k)).astype(np.int32)
        fast, ref = both_paths(lambda: cpu_gemv.row_axpy(c, q, slots))
        assert_same(fast, ref, f"row_axpy n={n} {scale_dtype} symmetric={symmetric}")
        fast, ref = both_paths(lambda: cpu_gemv.row_axpy(c, q, slots, dst, 3))
        assert_same(fast, ref, f"row_axpy (dst) n={n} {scale_dtype} symmetric={symmetric}")


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bits", [4, 8])
def test_avx512_block_axpy_has_the_avx2_bits(both_paths, bits, m):
    """block_axpy (convert --down-bits source: a block's rows summed, then scaled once): the same bits, whatever the
    block's length (runs of 1..40 rows) and the thread's share of columns."""
    rng = np.random.default_rng(200 + bits + m)
    for n, scale_dtype, symmetric in shapes(32, m):
        k = 90
        wq, _, _ = quantized(rng, 100, n, bits, 32, mx.float16)
        slots = rng.permutation(100)[:k].astype(np.int32)
        blocks = np.sort(rng.choice([0, 0, 1, 2, 2, 2, 3, 5], k)).astype(np.int32)
        S = mx.array(rng.uniform(0.5, 1.5, (6, n)).astype(np.float32)).astype(scale_dtype)
        B = None if symmetric else mx.array(rng.uniform(-1, 1, (6, n)).astype(np.float32)).astype(scale_dtype)
        c = rng.standard_normal((m, k)).astype(np.float32)
        c[:, 5] = 0.0
        c[0, 9] = 0.0
        dst = np.minimum(blocks // 2, 1).astype(np.int32)  # a block's rows share their dst

        def product(*extra):
            return cpu_gemv.block_axpy(c, wq, 0, wq.shape[1] * 4, slots, blocks, S, B, n, bits, *extra)

        fast, ref = both_paths(product)
        assert_same(fast, ref, f"block_axpy n={n} {scale_dtype} symmetric={symmetric}")
        fast, ref = both_paths(lambda: product(dst, 2))
        assert_same(fast, ref, f"block_axpy (dst) n={n} {scale_dtype} symmetric={symmetric}")


def test_avx512_switch(loops):
    """set_avx512 / MLX_FLASH_AVX512=0 choose the loops; info() says which run."""
    info = cpu_gemv.info()
    assert info["avx512"] == (AVX512_CPU and loops == "simd")
    cpu_gemv.set_avx512(False)
    try:
        assert not cpu_gemv.info()["avx512"]
    finally:
        cpu_gemv.set_avx512(True)
    code = "from mlx_flash.compute import cpu_gemv; print(cpu_gemv.info()['avx512'])"
    env = {**os.environ, "MLX_FLASH_AVX512": "0"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "0"


def _glu_case(rng, m: int, symmetric: bool):
    """(x [m, n], gate, up, slots, down's block_axpy arguments, dst) of 340 of 400 units, each unit's gate, up and
    down rows side by side in one buffer, in permuted slots; 7 partial sums, an outlier in x."""
    units, n, n_down = 400, 256, 512  # (two threads' worth of down rows)
    gate, up = unit_rows(rng, units, n, 4, 32)
    down = np.array(quantized(rng, units, n_down, 4, 32, mx.float16)[0]).view(np.uint8)
    buf = np.ascontiguousarray(np.concatenate([np.asarray(gate.w), down], 1))  # each unit: gate, up, then down
    gate, up = (
        cpu_gemv.QuantRows(buf, q.w_off, buf.shape[1], buf, q.s_off, buf.shape[1], buf, q.b_off, buf.shape[1], n, 4, 32,
                           mx.float16, symmetric)
        for q in (gate, up)
    )  # fmt: skip
    ids = np.sort(rng.choice(units, 340, replace=False)).astype(np.int32)  # the active units
    slots = rng.permutation(units)[: len(ids)].astype(np.int32)
    S = mx.array(rng.uniform(0.005, 0.02, (13, n_down)).astype(np.float32)).astype(mx.float16)
    B = None if symmetric else mx.array(rng.uniform(-0.1, 0.1, (13, n_down)).astype(np.float32)).astype(mx.float16)
    x = rng.standard_normal((m, n)).astype(np.float32)
    x[0, 7] = 40.0  # kept in float
    args = (buf, buf.shape[1] - down.shape[1], buf.shape[1], slots, ids // 32, S, B, n_down, 4)
    return x, gate, up, slots, args, (ids // 64).astype(np.int32)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_ffn_glu_is_its_three_products(loops, symmetric, m):
    """ffn_glu (a row's units in one pass: gate and up, the GLU, then down, a block of rows at a time) gives, bit for
    bit, row_dot_pairs -> glu_pairs -> block_axpy: units by slots in any order, blocks cut short, several partial
    sums, an outlier in x; the AVX-512 loops and the others alike, one position or several."""
    x, gate, up, slots, args, dst = _glu_case(np.random.default_rng(300 + m + 2 * symmetric), m, symmetric)
    blocks = args[4]

    def three():
        h = cpu_gemv.glu_pairs(cpu_gemv.row_dot_pairs(x, gate, up, slots))
        return cpu_gemv.block_axpy(h, *args, dst, 7)

    was = cpu_gemv.int8_activations()
    try:
        for int8, avx512 in ((True, True), (True, False), (False, True)):
            cpu_gemv.set_int8_activations(int8)
            cpu_gemv.set_avx512(avx512)
            want = three()
            assert np.abs(want).max() > 0
            assert_same(cpu_gemv.ffn_glu(x, gate, up, slots, args, dst, 7), want, f"int8={int8} avx512={avx512}")
    finally:
        cpu_gemv.set_avx512(True)
        cpu_gemv.set_int8_activations(was)
    pairs, gu = cpu_gemv._pairs_args(x, gate, up, slots, None)
    h = np.empty(gu.shape[:-1], np.float32)
    for c, what in ((h[..., :-1], "pairs' units"), (h[:, None].repeat(2, 1).reshape(2 * m, -1), "positions")):
        block, _ = cpu_gemv._block_args(c, *args[:3], slots[: c.shape[-1]], blocks[: c.shape[-1]], *args[5:], None, 1)
        with pytest.raises(ValueError, match=what):
            cpu_gemv._native.ffn_glu(pairs, block)
    h.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        cpu_gemv._native.ffn_glu(pairs, cpu_gemv._block_args(h, *args, None, 1)[0])


def test_a_bound_ffn_glu_reads_its_slots_as_they_are():
    """FfnGlu (ffn_glu bound to its rows, for a layer held whole) gives ffn_glu's bits for any x, and after the
    units move to other slots in place (a cache refilled in another order) it reads them where they now are."""
    rng = np.random.default_rng(310)
    x, gate, up, slots, args, dst = _glu_case(rng, 1, False)
    bound = cpu_gemv.FfnGlu(gate, up, slots, args, dst, 7)
    want = cpu_gemv.ffn_glu(x, gate, up, slots, args, dst, 7)
    assert_same(bound(x), want, "bound")
    assert_same(bound(x[0]), want[:, 0], "one row")
    buf, perm = args[0], rng.permutation(len(args[0]))
    buf[perm] = buf.copy()  # row r to row perm[r]
    slots[:] = perm[slots]
    assert_same(bound(x), want, "moved")
    x2 = rng.standard_normal((2, x.shape[1])).astype(np.float32)
    assert_same(bound(x2), cpu_gemv.ffn_glu(x2, gate, up, slots, args, dst, 7), "two positions")


@pytest.mark.parametrize("m", [1, 3, 17])
def test_a_bound_ffn_glu_folds_its_partial_sums_as_sum_rows_adds_them(loops, m):
    """FfnGlu(x, fold=True) (a prompt chunk's layer held whole) gives sum_rows of its partial sums, bit for bit: the
    first copied, each added in order as it ends, those no unit adds into (between others, and after the last) as
    zeros; on every loop path."""
    rng = np.random.default_rng(320 + m)
    x, gate, up, slots, args, dst = _glu_case(rng, m, False)
    bound = cpu_gemv.FfnGlu(gate, up, slots, args, 2 * dst + 1, 16)  # (partial sums 0, 2, 4, ... and 14, 15 empty)
    was = cpu_gemv.int8_activations()
    try:
        for int8, avx512 in ((True, True), (True, False), (False, True), (False, False)):
            cpu_gemv.set_int8_activations(int8)
            cpu_gemv.set_avx512(avx512)
            parts = bound(x)
            assert parts.shape == (16, m, args[7]) and np.abs(parts).max() > 0
            got = bound(x, fold=True)
            assert got.shape == (m, args[7])
            assert_same(got, cpu_gemv.sum_rows(parts), f"int8={int8} avx512={avx512}")
    finally:
        cpu_gemv.set_avx512(True)
        cpu_gemv.set_int8_activations(was)


@pytest.fixture(scope="module")
def portable_build(tmp_path_factory):
    """The extension as a CPU without x86's SIMD gets it (ARM: CPU_GEMV_NO_SIMD compiles the same loops out), loaded
    under another name beside the package's."""
    import importlib.util
    import shutil
    import sysconfig

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("portable") / ("_cpu_gemv" + sysconfig.get_config_var("EXT_SUFFIX"))
    src = os.path.join(os.path.dirname(__file__), "..", "kernels", "cpu_gemv.c")
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [cc, "-O1", "-shared", "-fPIC", "-DCPU_GEMV_NO_SIMD", f"-I{include}", src, "-o", str(out)], check=True
    )
    spec = importlib.util.spec_from_file_location("_cpu_gemv", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cpu_without_int8_loops_says_so(portable_build, loops):
    """Where no int8 loop exists (no x86 SIMD), info() reports float activations, and row_dot computes with them."""
    if loops == "scalar":
        pytest.skip("one build, one check")
    assert portable_build.info()["int8"] == 0
    rng = np.random.default_rng(3)
    wq, s, b = quantized(rng, 64, 256, 4, 32, mx.float32)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    out = np.empty((1, 64), np.float32)
    portable_build.row_dot(x, out, wq, 0, wq.shape[1] * 4, s, 0, s.shape[1] * 4, b, 0, b.shape[1] * 4, None, 64, 256, 4,
                           32, 2)  # fmt: skip
    assert np.allclose(out, reference(mx.array(x), wq, s, b, 32, 4, True), rtol=1e-5, atol=1e-4)
