"""ENDOR bitmap rows: encode/decode round-trip bit for bit for every stored dtype and edge case,
the documented byte layout, the fixed row size, MLX expand equals the numpy decoder, and the
Metal kernel equals the MLX path (Apple silicon only)."""

import ctypes
import shutil
import subprocess
import textwrap

import mlx_flash  # noqa: F401  (before mlx.core)
from mlx_flash.format import bitmap

import mlx.core as mx
import numpy as np
import pytest

DTYPES = ["float16", "bfloat16", "float32", "uint8"]
SHAPES = [(7, 1), (9, 8), (6, 31), (5, 32), (4, 33), (3, 100), (8, 576)]


def _random_bits(dtype, n, d, density, rng):
    """Random sparse rows as their bit patterns (uint8/16/32), NaN-free, with edge rows:
    row 0 all zero, row 1 all non-zero, and some -0.0 (sign bit only) entries."""
    if dtype == "uint8":
        bits = rng.integers(1, 256, (n, d)).astype(np.uint8)
    else:
        x = rng.standard_normal((n, d)).astype(np.float32)
        if dtype == "float16":
            bits = x.astype(np.float16).view(np.uint16)
        elif dtype == "bfloat16":
            bits = np.array(mx.view(mx.array(x).astype(mx.bfloat16), mx.uint16))
        else:
            bits = x.view(np.uint32)
        bits = bits.copy()
        bits[bits == 0] = 1  # keep "non-zero" positions non-zero
    keep = rng.random((n, d)) < density
    if n > 1:
        keep[1] = True
    bits = np.where(keep, bits, 0).astype(bits.dtype)
    bits[0] = 0
    if dtype != "uint8" and n > 2:
        sign = {"float16": 0x8000, "bfloat16": 0x8000, "float32": 0x80000000}[dtype]
        bits[2, ::3] = sign  # -0.0
    return bits


def _as_input(bits, dtype):
    """The form encode_rows takes for each dtype (bfloat16 as an mx array for variety)."""
    if dtype == "float16":
        return bits.view(np.float16)
    if dtype == "float32":
        return bits.view(np.float32)
    if dtype == "bfloat16":
        return mx.view(mx.array(bits), mx.bfloat16)
    return bits


def _bits_of(a, dtype):
    if isinstance(a, mx.array):
        return np.array(mx.view(a, {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[bitmap.DTYPES[dtype][0]]))
    return a.view(bitmap.DTYPES[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", SHAPES)
def test_roundtrip_is_bit_exact(dtype, n, d):
    rng = np.random.default_rng(n * 1000 + d)
    bits = _random_bits(dtype, n, d, 0.5, rng)
    enc, cap = bitmap.encode_rows(_as_input(bits, dtype))
    assert enc.dtype == np.uint8 and enc.shape == (n, bitmap.row_bytes(d, cap, dtype))
    assert cap == max(int((bits != 0).sum(1).max()), 1)
    np.testing.assert_array_equal(_bits_of(bitmap.decode_rows(enc, d, dtype), dtype), bits)
    np.testing.assert_array_equal(bitmap.counts(enc, d), (bits != 0).sum(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", SHAPES)
def test_mlx_expand_equals_numpy_decode(dtype, n, d):
    rng = np.random.default_rng(7 + n + d)
    bits = _random_bits(dtype, n, d, 0.4, rng)
    enc, _ = bitmap.encode_rows(_as_input(bits, dtype))
    out = bitmap.expand(mx.array(enc), d, dtype, use_metal=False)
    assert out.shape == (n, d) and out.dtype == bitmap.DTYPES[dtype][2]
    np.testing.assert_array_equal(_bits_of(out, dtype), _bits_of(bitmap.decode_rows(enc, d, dtype), dtype))


def test_negative_zero_is_stored_as_a_nonzero():
    rows = np.array([[0.0, -0.0, 1.5, 0.0]], np.float16)
    enc, cap = bitmap.encode_rows(rows)
    assert cap == 2 and bitmap.counts(enc, 4)[0] == 2
    assert enc[0, 0] == 0b0110  # bits 1 and 2
    out = bitmap.decode_rows(enc, 4, "float16")
    np.testing.assert_array_equal(out.view(np.uint16), rows.view(np.uint16))
    assert np.signbit(out[0, 1]) and not np.signbit(out[0, 0])


def test_byte_layout_matches_the_documentation():
    d = 40  # 2 bitmap words
    row = np.zeros((1, d), np.float32)
    row[0, [0, 9, 33]] = [1.0, -2.0, 3.0]
    enc, cap = bitmap.encode_rows(row, capacity=4)
    assert bitmap.values_offset(d) == 12 and enc.shape == (1, 12 + 16)
    words = enc[0, :8].view("<u4")
    assert words[0] == (1 << 0) | (1 << 9) and words[1] == 1 << (33 - 32)
    assert enc[0, 8:12].view("<u4")[0] == 3
    np.testing.assert_array_equal(enc[0, 12:].view("<f4"), [1.0, -2.0, 3.0, 0.0])


def test_fixed_capacity_rows_share_one_size_and_overflow_raises():
    rng = np.random.default_rng(1)
    bits = _random_bits("float16", 6, 64, 0.3, rng)
    enc, cap = bitmap.encode_rows(bits.view(np.float16), capacity=70)  # row 1 has 64 non-zeros
    assert cap == 70 and enc.shape[1] == bitmap.row_bytes(64, 70, "float16")
    np.testing.assert_array_equal(bitmap.decode_rows(enc, 64, "float16").view(np.uint16), bits)
    with pytest.raises(ValueError, match="capacity"):
        bitmap.encode_rows(bits.view(np.float16), capacity=40)
    with pytest.raises(ValueError, match="ambiguous"):
        bitmap.encode_rows(bits)


def test_expand_of_a_row_subset():
    """A cache gathers some rows: expanding rows [2, 0, 5] equals their decoded rows."""
    rng = np.random.default_rng(3)
    bits = _random_bits("bfloat16", 6, 70, 0.5, rng)
    enc, _ = bitmap.encode_rows(bits, dtype="bfloat16")
    idx = mx.array([2, 0, 5])
    out = bitmap.expand(mx.array(enc)[idx], 70, mx.bfloat16, use_metal=False)
    np.testing.assert_array_equal(np.array(mx.view(out, mx.uint16)), bits[[2, 0, 5]])


def test_compression_ratio_at_half_sparsity():
    d = 4096
    cap = bitmap.capacity_for_sparsity(d, 0.5)
    assert cap == 2048
    assert bitmap.compression_ratio(d, cap, "float16") == pytest.approx(0.5 + 1 / 16 + 4 / (2 * d))
    assert bitmap.compression_ratio(d, cap, "uint8") == pytest.approx(0.5 + 1 / 8 + 4 / d)


@pytest.mark.skipif(not bitmap.metal_available(), reason="Metal not available (Apple silicon only)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", SHAPES)
def test_metal_expand_equals_mlx(dtype, n, d):
    rng = np.random.default_rng(11 + n + d)
    bits = _random_bits(dtype, n, d, 0.5, rng)
    enc = mx.array(bitmap.encode_rows(_as_input(bits, dtype))[0])
    a = bitmap.expand(enc, d, dtype, use_metal=True)
    b = bitmap.expand(enc, d, dtype, use_metal=False)
    np.testing.assert_array_equal(_bits_of(a, dtype), _bits_of(b, dtype))


def test_explicit_mask_stores_the_masked_positions_for_quantised_values():
    """8-bit affine values: q = 0 may be a kept weight, and pruned positions are given by a mask."""
    rng = np.random.default_rng(9)
    q = rng.integers(0, 256, (5, 45)).astype(np.uint8)
    q[:, ::4] = 0  # kept weights whose quantised value is 0
    mask = rng.random((5, 45)) < 0.5
    mask[0] = False
    enc, cap = bitmap.encode_rows(q, mask=mask)
    assert cap == mask.sum(1).max()
    np.testing.assert_array_equal(bitmap.counts(enc, 45), mask.sum(1))
    np.testing.assert_array_equal(bitmap.decode_rows(enc, 45, "uint8"), np.where(mask, q, 0))
    np.testing.assert_array_equal(np.array(bitmap.expand_mask(mx.array(enc), 45)), mask)
    np.testing.assert_array_equal(
        np.array(bitmap.expand(mx.array(enc), 45, "uint8", use_metal=False)), np.where(mask, q, 0)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 3, 9])
def test_expand_with_group_fill(dtype, groups):
    """Unstored positions take their group's fill value (8-bit rows: the code of 0.0 per group)."""
    rng = np.random.default_rng(groups)
    n, d = 6, 576 // 64 * 2 * groups  # d divisible by groups
    bits = _random_bits(dtype, n, d, 0.5, rng)
    mask = bits != 0
    enc = mx.array(bitmap.encode_rows(_as_input(bits, dtype))[0])
    ubits = bitmap.DTYPES[dtype][1]
    fill_bits = rng.integers(1, 255, (n, groups)).astype(ubits)
    fill = mx.view(mx.array(fill_bits), bitmap.DTYPES[dtype][2])
    expected = np.where(mask, bits, np.repeat(fill_bits, d // groups, axis=1))
    for use_metal in [False] + ([True] if bitmap.metal_available() else []):
        got = bitmap.expand(enc, d, dtype, use_metal=use_metal, fill=fill)
        np.testing.assert_array_equal(_bits_of(got, dtype), expected)
    with pytest.raises(ValueError, match="fill must be"):
        bitmap.expand(enc, d, dtype, use_metal=False, fill=fill[:2])


# -- the Metal kernel body executed as C++ on the CPU (one emulated thread after another) ----

_CXX = shutil.which("g++") or shutil.which("clang++")
_STUBS = r"""
#include <cstddef>
#include <cstdint>
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
#define device
#define constant
static inline uint popcount(uint32_t v) { return __builtin_popcount(v); }
"""
_UTYPE = {1: "uint8_t", 2: "uint16_t", 4: "uint32_t"}


@pytest.mark.skipif(_CXX is None, reason="no C++ compiler")
def test_metal_kernel_body_emulated_on_cpu(tmp_path):
    """The body of kernels/bitmap_expand.metal, compiled as C++ with the template arguments the
    wrapper passes and run over the grid the wrapper launches, equals the numpy decoder."""
    cases, pieces = [], [_STUBS, bitmap.KERNEL_SOURCES.get("header", "")]
    rng = np.random.default_rng(21)
    for i, (dtype, (n, d)) in enumerate((dt, s) for dt in DTYPES for s in [(6, 31), (4, 33), (3, 100), (5, 64)]):
        bits = _random_bits(dtype, n, d, 0.5, rng)
        enc, cap = bitmap.encode_rows(_as_input(bits, dtype))
        size = bitmap.DTYPES[dtype][0]
        consts = dict(
            D=d,
            NWORDS=bitmap.bitmap_words(d),
            STRIDE=enc.shape[1],
            VAL_OFF=bitmap.values_offset(d),
            CAP=bitmap.capacity_of(enc.shape[1], d, dtype),
        )
        head = f"typedef {_UTYPE[size]} U;\n" + "\n".join(f"constexpr uint {k} = {v};" for k, v in consts.items())
        pieces.append(f"""
namespace k{i} {{
{head}
void kernel(const uint8_t* enc, U* out, uint3 thread_position_in_grid) {{
{textwrap.indent(bitmap.KERNEL_SOURCES["expand"], "    ")}
}}
}}
extern "C" void run{i}(const uint8_t* enc, void* out, uint k) {{
    for (uint r = 0; r < k; ++r)
        for (uint w = 0; w < k{i}::NWORDS; ++w) k{i}::kernel(enc, (k{i}::U*)out, uint3{{w, r, 0}});
}}
""")
        cases.append((i, dtype, n, d, enc))
    cpp = tmp_path / "bitmap_expand_emulated.cpp"
    cpp.write_text("\n".join(pieces))
    lib = tmp_path / "bitmap_expand_emulated.so"
    r = subprocess.run(
        [_CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-o", str(lib), str(cpp)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    so = ctypes.CDLL(str(lib))
    for i, dtype, n, d, enc in cases:
        ubits = bitmap.DTYPES[dtype][1]
        out = np.full((n, d), 0x5A, ubits)  # every element must be written
        getattr(so, f"run{i}")(
            np.ascontiguousarray(enc).ctypes.data_as(ctypes.c_void_p),
            out.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_uint(n),
        )
        np.testing.assert_array_equal(
            out, _bits_of(bitmap.decode_rows(enc, d, dtype), dtype), err_msg=f"{dtype} {n}x{d}"
        )
