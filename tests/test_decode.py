"""The native decode step: int8-activation matvecs (SIMD and scalar loops), the attention block, SiLU,
HostKVCache, and HostDecoder against mlx-lm's forward on SmolLM2."""

from mlx_flash.compute import cpu_gemv
from mlx_flash.engine.native_step import HostKVCache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = pytest.mark.native


@pytest.fixture(params=["simd", "scalar"])
def loops(request):
    cpu_gemv._native.set_simd(request.param == "simd")
    yield request.param
    cpu_gemv._native.set_simd(True)


def quantized(rng, rows, n, bits, group_size, scale_dtype):
    wq, s, b = mx.quantize(
        mx.array(rng.standard_normal((rows, n)).astype(np.float32)), group_size=group_size, bits=bits
    )
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    mx.eval(wq, s, b)
    return wq, s, b


def rounded(x, limit=6.0, max_outliers=8):
    """x as the int8 kernels see it: per block of 32 rounded to dx * int8 (dx = max|x| / 127), except the
    (at most 8) largest elements above `limit` rms(x), kept exactly."""
    x = x.astype(np.float32)
    big = np.flatnonzero(np.abs(x) > limit * np.sqrt(np.mean(x * x)))
    big = big[np.argsort(-np.abs(x[big]))][:max_outliers]
    rest = x.copy()
    rest[big] = 0
    blocks = rest.reshape(-1, 32)
    dx = np.abs(blocks).max(1, keepdims=True) / np.float32(127)
    q = np.rint(blocks / np.where(dx > 0, dx, 1)) * dx
    out = q.reshape(-1)
    out[big] = x[big]
    return out.astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size,n", [(32, 576), (32, 608), (64, 1024), (128, 1024)])  # 608: an unpaired block
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_int8_row_dot_is_the_product_with_rounded_x(loops, bits, group_size, n, scale_dtype):
    """The int8 path computes exactly W . x~ for the rounded x~ (integer block sums), outliers included, and
    x~ is close to x: within 1% of the float product's scale."""
    rng = np.random.default_rng(n + bits)
    wq, s, b = quantized(rng, 96, n, bits, group_size, scale_dtype)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, group_size, bits)
    x = rng.standard_normal(n).astype(np.float32)
    x[[5, 300]] = [40.0, -55.0]  # outlier channels, as a normed layer input has
    assert cpu_gemv.info()["int8"]
    got = cpu_gemv.row_dot(x, q, k=96)
    cpu_gemv.set_int8_activations(False)
    try:
        exact = cpu_gemv.row_dot(rounded(x), q, k=96)
        ref = cpu_gemv.row_dot(x, q, k=96)
    finally:
        cpu_gemv.set_int8_activations(True)
    scale = np.abs(ref).max()
    assert np.abs(got - exact).max() < 2e-5 * scale
    assert np.abs(got - ref).max() < 1e-2 * scale
    assert np.abs(got - ref).max() > 0  # the int8 path did run


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n", [96, 4096])
def test_int8_block_axpy_is_the_product_with_rounded_coefficients(loops, m, n):
    """A down projection of 4-bit source codes (block_axpy: a group's rows share each column's scale) rounds each
    position's coefficients of a group to int8, as llama.cpp rounds a down projection's input, but for a group's
    outlier (4x the next largest), which stays in float: the result is the float product with those coefficients
    (integer sums inside), within 1% of the float product, and the AVX-512 loops give the scalar loops' bits."""
    rng = np.random.default_rng(n + m)
    k, rows = 90, 100
    codes = rng.integers(0, 16, (rows, n)).astype(np.uint8)
    wq = mx.array((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.uint32))
    slots = rng.permutation(rows)[:k].astype(np.int32)
    blocks = np.sort(rng.choice([0, 0, 1, 2, 2, 2, 3, 5], k)).astype(np.int32)
    S = mx.array(rng.uniform(0.5, 1.5, (6, n)).astype(np.float32)).astype(mx.float16)
    c = rng.standard_normal((m, k)).astype(np.float32)
    c[:, 5] = 0.0
    c[0, 40] = 60.0  # a GLU's huge unit: kept in float, not rounding its group's others to a few levels

    def product(coeffs, biases=None):
        return cpu_gemv.block_axpy(coeffs, wq, 0, wq.shape[1] * 4, slots, blocks, S, biases, n, 4)

    cq = c.copy()  # each position's coefficients of each block, rounded as the kernel rounds them
    for p in range(m):
        for g in np.unique(blocks):
            sel = np.flatnonzero(blocks == g)
            a = np.sort(np.abs(c[p, sel]))[::-1]
            outlier = len(a) > 1 and a[0] > 4 * a[1]
            d = a[1 if outlier else 0] / np.float32(127)
            rounded = np.rint(c[p, sel] * (np.float32(1) / d)) * d
            if outlier:
                top = np.argmax(np.abs(c[p, sel]))
                rounded[top] = c[p, sel[top]]
                assert p == 0 and sel[top] == 40
            cq[p, sel] = rounded
    for biases in (None, S):  # symmetric codes, then biases of their own
        assert cpu_gemv.info()["int8"]
        got = product(c, biases)
        cpu_gemv.set_int8_activations(False)
        try:
            exact, ref = product(cq, biases), product(c, biases)
        finally:
            cpu_gemv.set_int8_activations(True)
        scale = np.abs(ref).max()
        assert np.abs(got - exact).max() < 2e-6 * scale
        assert 0 < np.abs(got - ref).max() < 1e-2 * scale  # (the int8 path did run)
        if loops == "simd" and cpu_gemv.info()["avx512"]:
            cpu_gemv._native.set_simd(False)
            try:
                assert np.array_equal(got, product(c, biases))
            finally:
                cpu_gemv._native.set_simd(True)


def test_outliers_keep_their_block_exact():
    """One huge element in a block leaves the other 31 rounded finely (the outlier stays in float)."""
    rng = np.random.default_rng(3)
    wq, s, b = quantized(rng, 64, 256, 4, 32, mx.float16)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, 32, 4)
    x = rng.standard_normal(256).astype(np.float32)
    x[7] = 200.0
    got = cpu_gemv.row_dot(x, q, k=64)
    cpu_gemv.set_int8_activations(False)
    try:
        ref = cpu_gemv.row_dot(x, q, k=64)
    finally:
        cpu_gemv.set_int8_activations(True)
    assert np.abs(got - ref).max() < 2e-3 * np.abs(ref).max()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("symmetric", [False, True])
def test_native_embedding_rows_are_mlxs(bits, dtype, symmetric):
    """cpu_gemv.embed gives, bit for bit, the rows MLX's quantised embedding gives: float16 or float32 scales, stored or
    derived (symmetric) biases, scales from zero to where s q nears float16's overflow; ids outside the table are
    refused."""
    rng = np.random.default_rng(bits)
    layer = cpu_gemv.patch(nn.Sequential(nn.QuantizedEmbedding(300, 128, group_size=32, bits=bits))).layers[0]
    s = rng.uniform(-1, 1, layer.scales.shape) * np.exp(rng.uniform(-12, 5.5, layer.scales.shape))
    s[0] = 0.0
    layer.scales = mx.array(s.astype(np.float32)).astype(dtype)
    if symmetric:
        del layer["biases"]
    else:
        layer.biases = mx.array(rng.standard_normal(layer.scales.shape).astype(np.float32) * 100).astype(dtype)
    assert cpu_gemv.embeds(layer)
    ids = rng.integers(0, 300, 64)
    want = np.array(layer(mx.array(ids)).astype(mx.float32))
    assert np.isfinite(want).all() and np.abs(want).max() > 100
    assert np.array_equal(cpu_gemv.embed(ids, layer).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="outside"):
        cpu_gemv.embed([3, 300], layer)


def test_silu_mul():
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((2, 1000)).astype(np.float32) * 4
    want = np.array(nn.silu(mx.array(g)) * mx.array(u))
    cpu_gemv.silu_mul(g, u)
    assert np.allclose(g, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one length"):
        cpu_gemv.silu_mul(g, u[:10])


def _block(rng, d=128, nh=4, nkv=2, hd=32):
    """A random attention block's weights: q, k, v, o as (wq, s, b), norms."""
    mats = [
        quantized(rng, r, c, 4, 32, mx.float16) for r, c in ((nh * hd, d), (nkv * hd, d), (nkv * hd, d), (d, nh * hd))
    ]
    return mats, rng.uniform(0.5, 1.5, d).astype(np.float32), rng.uniform(0.5, 1.5, d).astype(np.float32)


def _mlx_block(x, mats, n1, n2, K, V, pos, nh, nkv, hd, base=10000.0):
    """The same block in MLX ops (mlx-lm's llama attention, one token): (x out, h out, k, v)."""

    def lin(v, m):
        wq, s, b = m
        return mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), 32, 4) @ v

    xm = mx.array(x)
    h = mx.fast.rms_norm(xm, mx.array(n1), 1e-5)
    q = lin(h, mats[0]).reshape(1, nh, 1, hd)
    k = lin(h, mats[1]).reshape(1, nkv, 1, hd)
    v = lin(h, mats[2]).reshape(1, nkv, 1, hd)
    q = mx.fast.rope(q, hd, traditional=False, base=base, scale=1.0, offset=pos)
    k = mx.fast.rope(k, hd, traditional=False, base=base, scale=1.0, offset=pos)
    keys = mx.concatenate([mx.array(K[None, :, :pos]), k], axis=2)
    vals = mx.concatenate([mx.array(V[None, :, :pos]), v], axis=2)
    a = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=hd**-0.5)
    xo = xm + lin(a.reshape(-1), mats[3])
    return np.array(xo), np.array(mx.fast.rms_norm(xo, mx.array(n2), 1e-5)), np.array(k).reshape(nkv, hd)


def _attention_case(seed, nh, nkv, hd, d=128, cap=16, pos=9):
    """A random block's handles, cache and input, their native attention's arguments after x and h, and the block in
    MLX ops (x, h, k)."""
    rng = np.random.default_rng(seed)
    mats, n1, n2 = _block(rng, d, nh, nkv, hd)
    handles = [cpu_gemv.linear(cpu_gemv.QuantRows.of_matrix(*m, 32, 4), m[0].shape[0]) for m in mats]
    K = rng.standard_normal((nkv, cap, hd)).astype(np.float32)
    V = rng.standard_normal((nkv, cap, hd)).astype(np.float32)
    x = rng.standard_normal(d).astype(np.float32)
    want = _mlx_block(x, mats, n1, n2, K, V, pos, nh, nkv, hd)
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    args = (n1, n2, 1e-5, *handles, K, V, pos, cap, nh, nkv, hd, inv_freq, False, 1.0, hd**-0.5)
    return x, args, want


def test_attention_block_equals_mlx(float_activations):
    x, args, (want_x, want_h, want_k) = _attention_case(5, 4, 2, 32)
    h = np.empty_like(x)
    cpu_gemv._native.attention(x, h, *args)
    n1, n2, eps, *handles = args[:7]
    K, V, pos, cap, nh, nkv, hd, inv_freq = args[7:15]
    assert np.allclose(x, want_x, rtol=1e-4, atol=1e-4)
    assert np.allclose(h, want_h, rtol=1e-4, atol=1e-4)
    assert np.allclose(K[:, pos], want_k, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="shapes disagree"):  # pos past the cache
        cpu_gemv._native.attention(x, h, n1, n2, 1e-5, *handles, K, V, cap, cap, nh, nkv, hd, inv_freq, False, 0.0, 1.0)
    with pytest.raises(ValueError, match="shapes disagree"):  # q's rows are not heads x head_dim
        cpu_gemv._native.attention(
            x, h, n1, n2, 1e-5, *handles, K, V, 0, cap, nh, nkv, hd // 2, inv_freq, False, 0.0, 1.0
        )
    with pytest.raises(TypeError, match="linear"):
        cpu_gemv._native.attention(
            x, h, n1, n2, 1e-5, handles[0], None, *handles[2:], K, V, 0, cap, nh, nkv, hd, inv_freq, False, 0.0, 1.0
        )


@pytest.mark.parametrize("avx512", [False, True])
def test_int8_attention_block_is_mlx_within_its_rounding(avx512):
    """With int8 activations (the default) q, k and v come from one quantised input in one pass over their rows:
    each matrix's results land in its own place, k and v of 18 rows (not a multiple of the 4 rows the loops take at
    once) too, within the activations' rounding of MLX's block on either loop width."""
    x, args, (want_x, _, want_k) = _attention_case(7, 16, 1, 18)
    x0, h = x.copy(), np.empty_like(x)
    cpu_gemv.set_avx512(avx512)
    try:
        cpu_gemv._native.attention(x, h, *args)
    finally:
        cpu_gemv.set_avx512(True)
    K, pos = args[7], args[9]
    assert np.abs(x - want_x).max() < 0.03 * np.abs(want_x - x0).max()
    assert np.abs(K[:, pos] - want_k).max() < 0.03 * np.abs(want_k).max()


@pytest.mark.parametrize("int8, avx512", [(True, True), (True, False), (False, True)])
def test_interleaved_projections_have_the_rows_bits(int8, avx512):
    """An attention block whose projections are held interleaved (cpu_gemv.interleave, for the AVX-512 loops)
    gives, bit for bit, what their rows give: on those loops, on the others (which read a copy in rows) and with float
    activations; several positions, an outlier in the input."""
    rng = np.random.default_rng(8)
    d, nh, nkv, hd, cap, pos, m = 256, 4, 2, 64, 16, 3, 5  # (rows of whole 64-byte chunks)
    mats, n1, n2 = _block(rng, d, nh, nkv, hd)
    x = rng.standard_normal((m, d)).astype(np.float32)
    x[1, 200] = 80.0  # an outlier after the norm (its codes read one by one), past the first chunk
    K, V = rng.standard_normal((2, nkv, cap, hd)).astype(np.float32)
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    rows = [cpu_gemv.linear(cpu_gemv.QuantRows.of_matrix(*mt, 32, 4), mt[0].shape[0]) for mt in mats]
    mixed = [cpu_gemv.interleave(mt[0]) for mt in mats]
    assert all(
        not mx.array_equal(a, mt[0]) and mx.array_equal(cpu_gemv.deinterleave(a), mt[0]) for a, mt in zip(mixed, mats)
    )
    ilv = [
        cpu_gemv.linear(cpu_gemv.QuantRows.of_matrix(a, *mt[1:], 32, 4), a.shape[0], True) for a, mt in zip(mixed, mats)
    ]

    def block(handles):
        xs, h, Ks, Vs = x.copy(), np.empty_like(x), K.copy(), V.copy()
        cpu_gemv._native.attention(xs, h, n1, n2, 1e-5, *handles, Ks, Vs, pos, cap, nh, nkv, hd, inv_freq, False, 1.0,
                                   hd**-0.5)  # fmt: skip
        return xs, h, Ks, Vs

    was = cpu_gemv.int8_activations()
    cpu_gemv.set_int8_activations(int8)
    cpu_gemv.set_avx512(avx512)
    try:
        want, got = block(rows), block(ilv)
    finally:
        cpu_gemv.set_avx512(True)
        cpu_gemv.set_int8_activations(was)
    for a, b, what in zip(want, got, ("x", "h", "keys", "values")):
        assert np.array_equal(a, b), what
    assert not np.array_equal(want[0], x)
    with pytest.raises(ValueError, match="interleaved"):  # rows of part of a chunk
        cpu_gemv.linear(cpu_gemv.QuantRows.of_matrix(*quantized(rng, 8, 96, 4, 32, mx.float16), 32, 4), 8, True)


def test_an_interleaved_linear_computes_with_its_rows():
    """A layer held interleaved (cpu_gemv.interleave_layer) computes through MLX's ops (prompts in mlx-lm's forward)
    as before, bit for bit, one row or several, in the same memory."""
    layer = cpu_gemv.patch(nn.Sequential(nn.QuantizedLinear(256, 64, bias=False, group_size=32, bits=4))).layers[0]
    x = mx.random.normal((3, 256), key=mx.random.key(4))
    want, want1, w = layer(x), layer(x[:1]), layer.weight
    cpu_gemv.interleave_layer(layer)
    assert type(layer) is cpu_gemv.InterleavedLinear and layer.weight.nbytes == w.nbytes
    assert mx.array_equal(cpu_gemv.deinterleave(layer.weight), w) and not mx.array_equal(layer.weight, w)
    assert mx.array_equal(layer(x), want) and mx.array_equal(layer(x[:1]), want1)


@pytest.mark.parametrize("kv", [np.float32, np.float16])
@pytest.mark.parametrize("int8", [False, True])
def test_attention_of_several_positions_equals_one_at_a_time(int8, kv):
    """A block over m positions (a verification pass) is, bit for bit, m blocks of one position in turn: causal,
    each position's keys written where the next one reads them (in a float32 or a float16 cache)."""
    rng = np.random.default_rng(6)
    d, nh, nkv, hd, cap, pos, m = 128, 4, 2, 32, 24, 5, 7
    mats, n1, n2 = _block(rng, d, nh, nkv, hd)
    handles = [cpu_gemv.linear(cpu_gemv.QuantRows.of_matrix(*mm, 32, 4), mm[0].shape[0]) for mm in mats]
    K = rng.standard_normal((nkv, cap, hd)).astype(kv)
    V = rng.standard_normal((nkv, cap, hd)).astype(kv)
    x = rng.standard_normal((m, d)).astype(np.float32)
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    cpu_gemv.set_int8_activations(int8)
    try:
        x1, h1, K1, V1 = x.copy(), np.empty_like(x), K.copy(), V.copy()
        for p in range(m):
            row, h = x1[p].copy(), np.empty(d, np.float32)
            cpu_gemv._native.attention(
                row, h, n1, n2, 1e-5, *handles, K1, V1, pos + p, cap, nh, nkv, hd, inv_freq, False, 1.0, hd**-0.5
            )
            x1[p], h1[p] = row, h
        hm = np.empty_like(x)
        cpu_gemv._native.attention(
            x, hm, n1, n2, 1e-5, *handles, K, V, pos, cap, nh, nkv, hd, inv_freq, False, 1.0, hd**-0.5
        )
    finally:
        cpu_gemv.set_int8_activations(True)
    assert np.array_equal(x, x1) and np.array_equal(hm, h1)
    assert np.array_equal(K, K1) and np.array_equal(V, V1)
    qn = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    with pytest.raises(ValueError, match="go together"):  # (Qwen3's per-head norms: both or neither)
        cpu_gemv._native.attention(
            x, hm, n1, n2, 1e-5, *handles, K, V, pos, cap, nh, nkv, hd, inv_freq, False, 1.0, 1.0, qn, None, 1e-6
        )
    with pytest.raises(ValueError, match=r"\[head_dim\]"):
        cpu_gemv._native.attention(
            x,
            hm,
            n1,
            n2,
            1e-5,
            *handles,
            K,
            V,
            pos,
            cap,
            nh,
            nkv,
            hd,
            inv_freq,
            False,
            1.0,
            1.0,
            qn[:-1],
            qn[:-1],
            1e-6,
        )
    with pytest.raises(ValueError, match="shapes disagree"):  # the last position past the cache
        cpu_gemv._native.attention(
            x, hm, n1, n2, 1e-5, *handles, K, V, cap - m + 1, cap, nh, nkv, hd, inv_freq, False, 1.0, 1.0
        )


def test_a_float16_cache_holds_the_rounded_keys(loops):
    """A float16 KV cache stores each new key and value as numpy rounds it (to nearest even) and attends to what it
    holds: the block's output stays within float16's precision of a float32 cache's. Other dtypes are refused."""
    rng = np.random.default_rng(8)
    d, nh, nkv, hd, cap, pos, m = 128, 4, 2, 32, 24, 5, 7
    mats, n1, n2 = _block(rng, d, nh, nkv, hd)
    handles = [cpu_gemv.linear(cpu_gemv.QuantRows.of_matrix(*mm, 32, 4), mm[0].shape[0]) for mm in mats]
    K16 = rng.standard_normal((nkv, cap, hd)).astype(np.float16)
    V16 = rng.standard_normal((nkv, cap, hd)).astype(np.float16)
    K32, V32 = K16.astype(np.float32), V16.astype(np.float32)  # the same earlier keys, exactly
    x = rng.standard_normal((m, d)).astype(np.float32)
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    out = {}
    for name, K, V in (("f32", K32, V32), ("f16", K16, V16)):
        xs, h = x.copy(), np.empty_like(x)
        cpu_gemv._native.attention(
            xs, h, n1, n2, 1e-5, *handles, K, V, pos, cap, nh, nkv, hd, inv_freq, False, 1.0, 0.2
        )
        out[name] = xs
    new = slice(pos, pos + m)
    assert np.array_equal(K16[:, new].view(np.uint16), K32[:, new].astype(np.float16).view(np.uint16))
    assert np.array_equal(V16[:, new].view(np.uint16), V32[:, new].astype(np.float16).view(np.uint16))
    assert not np.array_equal(out["f16"], out["f32"])  # the rounded keys were read
    assert np.abs(out["f16"] - out["f32"]).max() < 1e-2 * np.abs(out["f32"] - x).max()  # of the block's output
    halves = np.empty(1000, np.float16)
    src = np.concatenate([rng.standard_normal(990) * 10.0 ** rng.integers(-9, 5, 990), [6e-8, 3e-8, 65519, 65520]])
    cpu_gemv._native.halves(src.astype(np.float32), halves[:994])
    with np.errstate(over="ignore"):  # (65520 rounds to inf)
        ref = src.astype(np.float32).astype(np.float16)
    assert np.array_equal(halves[:994].view(np.uint16), ref.view(np.uint16))
    with pytest.raises(TypeError, match="float32 or float16"):
        cpu_gemv._native.attention(
            x, h, n1, n2, 1e-5, *handles, K32.astype(np.float64), V32, pos, cap, nh, nkv, hd, inv_freq, False, 1, 1
        )


def test_linear_checks_its_rows():
    rng = np.random.default_rng(0)
    wq, s, b = quantized(rng, 8, 64, 4, 32, mx.float16)
    q = cpu_gemv.QuantRows.of_matrix(wq, s, b, 32, 4)
    with pytest.raises(IndexError, match="outside"):
        cpu_gemv.linear(q, 9)


def test_host_kv_cache_is_an_mlx_lm_cache():
    c = HostKVCache(step=4)
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    keys, values = c.update_and_fetch(k, -k)
    assert keys.shape == (1, 2, 3, 4) and np.array_equal(np.array(values), -np.array(k))
    c.update_and_fetch(k[:, :, :2] + 100, k[:, :, :2])  # grows past its step
    assert (
        c.offset == 5 and c._k.shape[2] == 8 and np.array_equal(np.array(c.keys[:, :, 3:]), np.array(k[:, :, :2] + 100))
    )
    assert c.trim(2) == 2 and c.offset == 3 and c.keys.shape[2] == 3
    d = HostKVCache.from_state(c.state)
    assert d.offset == 3 and np.array_equal(np.array(d.keys), np.array(c.keys)) and d.nbytes > 0
    with pytest.raises(ValueError, match="one sequence"):
        c.update_and_fetch(mx.zeros((2, 2, 1, 4)), mx.zeros((2, 2, 1, 4)))


def _greedy(model, prompt, n=24):
    from mlx_flash.generate import generate_step

    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_native_step_gives_mlx_lm_forward_tokens(smol, float_activations):
    """SmolLM2 (convert's defaults, everything resident): the native decode step's greedy tokens are those of
    mlx-lm's forward over the same engine, and its caches hold the same keys."""
    from mlx_flash.loader import load

    model, tok = load(smol)
    assert model.forward.native, model.forward.why
    prompt = tok.encode("The history of the city begins")
    native = _greedy(model, prompt)
    a, b = model.make_cache(), model.make_cache()
    assert all(type(c) is HostKVCache for c in a)
    decoder, model.forward = model.forward, None
    try:
        assert _greedy(model, prompt) == native
        # one step each way from the same prompt cache: same logits and keys
        model(mx.array([prompt]), cache=a), model(mx.array([prompt]), cache=b)
        la, lb = np.array(model(mx.array([[native[0]]]), cache=a)), np.array(decoder([native[0]], b))
        assert np.abs(la - lb).max() < 1e-3 * np.abs(la).max()
        assert np.allclose(a[5]._k[:, :, : a[5].offset], b[5]._k[:, :, : b[5].offset], atol=1e-4)
    finally:
        model.forward = decoder
        model.flash.close()


def test_streamed_native_steps_equal_resident(smol, float_activations):
    """The FFN streamed through caches of a third of it: the resident model's tokens. A streamed layer sums its
    units in parts (cached, read, read ahead), so its float32 output differs from the resident one's in the last
    bits; with int8 activations such a difference can flip the rounding of the next layer's input (SmolLM2's
    residual reaches |x| ~ 1000), and the two drift apart by ~0.3 in log-probability: token identity over a long
    horizon is a float32-activation property."""
    from mlx_flash.budget import min_budget
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.loader import kv_size_of, load

    resident, tok = load(smol)
    prompt = tok.encode("Once upon a time")
    want = _greedy(resident, prompt, 32)
    resident.flash.close()
    fd = FlashDir(smol)
    model, _ = load(smol, memory_budget=min_budget(fd, 128, kv_size_of(fd)) + fd.ffn_bytes // 3, context=128)
    try:
        assert model.forward.native
        assert _greedy(model, prompt, 32) == want
        model.flash.stats.end()
        assert sum(t.misses for t in model.flash.stats.decode_tokens()) > 0
    finally:
        model.flash.close()
