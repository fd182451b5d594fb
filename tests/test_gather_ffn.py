"""compute: row_dot / row_axpy straight from cache rows, against float64 numpy references.

The MLX-ops path runs everywhere; the native CPU path (cpu_gemv) wherever MLX computes on the
CPU, with its SIMD and its scalar loops. The Metal kernels run only on Apple silicon: their
comparisons against the MLX-ops path are skipped elsewhere. Where a C++ compiler exists,
the kernel bodies of kernels/gather_ffn.metal are also compiled as C++ with stubbed Metal
builtins and executed on CPU threads (simd_sum and threadgroup barriers emulated): that
checks their indexing, bit unpacking and reductions, not the Metal compiler or the GPU.
"""

import ctypes
import shutil
import subprocess
import textwrap

from mlx_flash.compute import backends as gf
from mlx_flash.compute import metal as gm
from mlx_flash.compute.ffn import ACTIVATIONS, ffn_forward, project
from mlx_flash.format.layout import BundleLayout, row_matrix

import mlx.core as mx
import numpy as np
import pytest

KINDS = ["float32", "float16", "bfloat16", "q4", "q8"]
FLOAT = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
METAL = pytest.mark.skipif(not mx.metal.is_available(), reason="Metal not available (Apple silicon only)")


# -- stored matrices and their float64 truth ------------------------------------------


def dequantize_np(w, scales, biases, bits, group_size, magnitude=False):
    """MLX affine dequantisation in numpy float64, written from the format (not mx.dequantize).

    magnitude=True gives |scale| * q + |bias| instead: the size of the terms, for error bounds."""
    w = np.asarray(w, dtype=np.uint32)
    per = 32 // bits
    shifts = (bits * np.arange(per)).astype(np.uint32)
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*w.shape[:-1], -1).astype(np.float64)
    s = np.repeat(np.asarray(scales, dtype=np.float64), group_size, axis=-1)
    b = np.repeat(np.asarray(biases, dtype=np.float64), group_size, axis=-1)
    return np.abs(s) * q + np.abs(b) if magnitude else s * q + b


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def make_matrix(rng, name, kind, n_units, length):
    """Stored rows of matrix `name` -> ({component: array}, float64 truth [n_units, length],
    magnitude of its terms (for error bounds), quant)."""
    dense = mx.array(rng.standard_normal((n_units, length)).astype(np.float32))
    if kind in FLOAT:
        stored = dense.astype(FLOAT[kind])
        return {f"{name}.weight": stored}, to_np(stored), np.abs(to_np(stored)), None
    bits = int(kind[1:])
    group_size = int(rng.choice([g for g in (32, 64, 128) if length % g == 0]))
    w, s, b = mx.quantize(dense, group_size, bits)
    sdt = [mx.float16, mx.bfloat16, mx.float32][rng.integers(3)]
    s, b = s.astype(sdt), b.astype(sdt)
    truth = dequantize_np(np.array(w), to_np(s), to_np(b), bits, group_size)
    mag = dequantize_np(np.array(w), to_np(s), to_np(b), bits, group_size, magnitude=True)
    arrays = {f"{name}.weight": w, f"{name}.scales": s, f"{name}.biases": b}
    return arrays, truth, mag, {"bits": bits, "group_size": group_size}


class Cache:
    """A random layout of several matrices, packed, with the units placed in shuffled cache slots."""

    def __init__(self, rng, matrices, n_units, alignment=512, pad=False, spare=3):
        arrays, self.truth, self.mag, self.quant = {}, {}, {}, {}
        if pad:  # odd-sized leading component: every later offset is unaligned
            arrays["pad.weight"] = mx.array(rng.integers(0, 255, (n_units, 3)).astype(np.uint8))
        for name, (kind, length) in matrices.items():
            a, self.truth[name], self.mag[name], self.quant[name] = make_matrix(rng, name, kind, n_units, length)
            arrays.update(a)
        self.layout = BundleLayout.from_arrays(arrays, alignment)
        packed = self.layout.pack(arrays)
        self.capacity = n_units + spare  # spare rows hold garbage, never referenced
        host = rng.integers(0, 255, (self.capacity, self.layout.stride)).astype(np.uint8)
        self.slot_of_unit = rng.permutation(self.capacity)[:n_units]
        host[self.slot_of_unit] = packed
        self.rows = mx.array(host)
        self.n_units = n_units

    def slots_for(self, units):
        return mx.array(self.slot_of_unit[np.asarray(units, dtype=np.int64)].astype(np.int32))

    def rows_of(self, name, units):
        return self.truth[name][np.asarray(units, dtype=np.int64)]

    def mag_of(self, name, units):
        """|terms| of the rows: |W| (float) or |scale| * q + |bias| (quantised)."""
        return self.mag[name][np.asarray(units, dtype=np.int64)]


def unit_lists(rng, n):
    """Active sets: repeats + unsorted, empty, single, every unit (permuted; k = capacity without spare rows)."""
    return {
        "repeats": rng.integers(0, n, 2 * n // 3),
        "empty": np.zeros(0, dtype=np.int64),
        "single": np.array([rng.integers(n)]),
        "all": rng.permutation(n),
    }


TOL = {mx.float32: 2e-5, mx.float16: 3e-3, mx.bfloat16: 2.5e-2}


def assert_close(out, ref, scale, dtype):
    """|out - ref| <= tol * scale elementwise, scale = the sum of |terms| (robust to cancellation)."""
    out = to_np(out)
    assert out.shape == ref.shape
    bad = np.abs(out - ref) > TOL[dtype] * (scale + 1e-6)
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; max err {np.abs(out - ref).max()}"


# -- MLX-ops path vs numpy -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alignment", [512, 4096])
@pytest.mark.usefixtures("mlx_ops")
def test_row_dot_and_row_axpy_match_numpy(kind, alignment):
    rng = np.random.default_rng(KINDS.index(kind) + alignment)
    d, n_out = 128, 64
    other = KINDS[(KINDS.index(kind) + 1) % len(KINDS)]
    c = Cache(
        rng,
        {"gate": (kind, d), "up": (other, d), "down": (kind, n_out)},
        n_units=21,
        alignment=alignment,
        spare=3 if alignment == 512 else 0,
    )
    x = rng.standard_normal((3, d)).astype(np.float32)
    for case, units in unit_lists(rng, c.n_units).items():
        slots = c.slots_for(units)
        for name in ("gate", "up"):
            W = c.rows_of(name, units)
            M = c.mag_of(name, units)
            out = gf.row_dot(mx.array(x), c.rows, slots, c.layout, name, c.quant[name])
            assert out.dtype == mx.float32 and out.shape == (3, len(units)), case
            assert_close(out, x @ W.T, np.abs(x) @ M.T, mx.float32)
        w = rng.standard_normal((3, len(units))).astype(np.float32)
        W = c.rows_of("down", units)
        M = c.mag_of("down", units)
        out = gf.row_axpy(mx.array(w), c.rows, slots, c.layout, "down", c.quant["down"])
        assert out.shape == (3, n_out), case
        assert_close(out, w @ W, np.abs(w) @ M, mx.float32)


@pytest.mark.parametrize("xdtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q4"])
def test_computes_in_the_dtype_of_x(xdtype, kind):
    rng = np.random.default_rng(7)
    c = Cache(rng, {"fc1": (kind, 64), "fc2": (kind, 96)}, n_units=16)
    units = rng.integers(0, 16, 10)
    slots = c.slots_for(units)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32)).astype(xdtype)
    out = gf.row_dot(x, c.rows, slots, c.layout, "fc1", c.quant["fc1"])
    assert out.dtype == xdtype
    xn, W = to_np(x), c.rows_of("fc1", units)
    M = c.mag_of("fc1", units)
    assert_close(out, xn @ W.T, np.abs(xn) @ M.T, xdtype)
    w = mx.array(rng.standard_normal((2, 10)).astype(np.float32)).astype(xdtype)
    out = gf.row_axpy(w, c.rows, slots, c.layout, "fc2", c.quant["fc2"])
    assert out.dtype == xdtype
    wn, W = to_np(w), c.rows_of("fc2", units)
    M = c.mag_of("fc2", units)
    assert_close(out, wn @ W, np.abs(wn) @ M, xdtype)


@pytest.mark.usefixtures("mlx_ops")
def test_leading_dims_unaligned_offsets_and_slot_types():
    rng = np.random.default_rng(3)
    c = Cache(rng, {"gate": ("float16", 64), "up": ("q8", 64), "down": ("float32", 32)}, n_units=9, pad=True)
    assert any(not gm.supports(row_matrix(c.layout, n)) for n in ("gate", "down"))  # misaligned after the pad
    units = np.array([8, 0, 0, 5])
    x = rng.standard_normal((2, 1, 64)).astype(np.float32)  # [B, L, d] as the model calls it
    for slots in (
        c.slots_for(units),
        np.asarray(c.slot_of_unit[units]),
        list(c.slot_of_unit[units]),
        c.slots_for(units).astype(mx.int64),
    ):
        for name in ("gate", "up"):
            out = gf.row_dot(mx.array(x), c.rows, slots, c.layout, name, c.quant[name])
            W = c.rows_of(name, units)
            M = c.mag_of(name, units)
            assert_close(out, x @ W.T, np.abs(x) @ M.T, mx.float32)
    h = rng.standard_normal((2, 1, 4)).astype(np.float32)
    out = gf.row_axpy(mx.array(h), c.rows, c.slots_for(units), c.layout, "down", None)
    W = c.rows_of("down", units)
    M = c.mag_of("down", units)
    assert out.shape == (2, 1, 32)
    assert_close(out, h @ W, np.abs(h) @ M, mx.float32)


def test_numpy_dequantisation_is_mlx_dequantisation():
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        dense = mx.array(rng.standard_normal((5, 128)).astype(np.float32))
        w, s, b = mx.quantize(dense, 64, bits)
        ref = dequantize_np(np.array(w), np.array(s), np.array(b), bits, 64)
        np.testing.assert_allclose(ref, np.array(mx.dequantize(w, s, b, 64, bits)), rtol=1e-6, atol=1e-6)


# -- whole FFNs from the primitives ----------------------------------------------------


def ffn_info(kind_of, transposed):
    return {name: {"quantization": q, "transposed": transposed[name]} for name, q in kind_of.items()}


@pytest.mark.parametrize("kinds", [("float32", "float32"), ("float16", "q8"), ("q4", "q4"), ("bfloat16", "q4")])
def test_glu_ffn_equals_ffn_forward(kinds):
    rng = np.random.default_rng(11)
    d = 128
    c = Cache(rng, {"gate": (kinds[0], d), "up": (kinds[0], d), "down": (kinds[1], d)}, n_units=40, alignment=4096)
    ffn = {
        "kind": "glu",
        "activation": "silu",
        "matrices": ffn_info(c.quant, {"gate": False, "up": False, "down": True}),
    }
    x = mx.array(rng.standard_normal((1, 1, d)).astype(np.float32))
    for units in (rng.choice(40, 12, replace=False), np.arange(40)):
        slots = c.slots_for(units)
        ref = ffn_forward(x, c.layout.unpack(mx.take(c.rows, slots, axis=0)), ffn)
        act = ACTIVATIONS["silu"]
        h = act(gf.row_dot(x, c.rows, slots, c.layout, "gate", c.quant["gate"])) * gf.row_dot(
            x, c.rows, slots, c.layout, "up", c.quant["up"]
        )
        y = gf.row_axpy(h, c.rows, slots, c.layout, "down", c.quant["down"])
        np.testing.assert_allclose(np.array(y), np.array(ref), rtol=1e-4, atol=1e-4 * float(mx.abs(ref).max()))


@pytest.mark.parametrize("kinds", [("float32", "float16"), ("q8", "q4")])
def test_relu_ffn_with_biases_equals_ffn_forward(kinds):
    rng = np.random.default_rng(12)
    d, n = 64, 30
    c = Cache(rng, {"fc1": (kinds[0], d), "fc2": (kinds[1], d)}, n_units=n)
    ffn = {"kind": "relu", "activation": "relu", "matrices": ffn_info(c.quant, {"fc1": False, "fc2": True})}
    b1 = mx.array(rng.standard_normal(n).astype(np.float32))
    b2 = mx.array(rng.standard_normal(d).astype(np.float32))
    x = mx.array(rng.standard_normal((2, d)).astype(np.float32))
    units = rng.choice(n, 9, replace=False)
    slots = c.slots_for(units)
    b1_active = b1[mx.array(units)]
    ref = ffn_forward(x, c.layout.unpack(mx.take(c.rows, slots, axis=0)), ffn, {"fc1": b1_active, "fc2": b2})
    h = mx.maximum(gf.row_dot(x, c.rows, slots, c.layout, "fc1", c.quant["fc1"]) + b1_active, 0)
    y = gf.row_axpy(h, c.rows, slots, c.layout, "fc2", c.quant["fc2"]) + b2
    np.testing.assert_allclose(np.array(y), np.array(ref), rtol=1e-4, atol=1e-4 * float(mx.abs(ref).max()))


def test_dip_layout_gate_up_by_input_columns():
    """dip: gate/up rows are input columns (row_axpy with the pruned input), down rows by neuron."""
    rng = np.random.default_rng(13)
    d, n = 64, 96
    inputs = Cache(rng, {"gate": ("q4", n), "up": ("float16", n)}, n_units=d)
    neurons = Cache(rng, {"down": ("q8", d)}, n_units=n)
    x = mx.array(rng.standard_normal((1, d)).astype(np.float32))
    cols = np.sort(rng.choice(d, 20, replace=False))
    x_in = x[:, mx.array(cols)]
    s_in = inputs.slots_for(cols)
    act = ACTIVATIONS["silu"]
    g = gf.row_axpy(x_in, inputs.rows, s_in, inputs.layout, "gate", inputs.quant["gate"])
    u = gf.row_axpy(x_in, inputs.rows, s_in, inputs.layout, "up", inputs.quant["up"])
    h = act(g) * u
    keep = rng.choice(n, 30, replace=False)
    y = gf.row_axpy(
        h[:, mx.array(keep)], neurons.rows, neurons.slots_for(keep), neurons.layout, "down", neurons.quant["down"]
    )
    a_in = inputs.layout.unpack(mx.take(inputs.rows, s_in, axis=0))
    g_ref = project(x_in, a_in, "gate", {"quantization": inputs.quant["gate"], "transposed": True})
    u_ref = project(x_in, a_in, "up", {"quantization": None, "transposed": True})
    a_out = neurons.layout.unpack(mx.take(neurons.rows, neurons.slots_for(keep), axis=0))
    y_ref = project(
        (act(g_ref) * u_ref)[:, mx.array(keep)],
        a_out,
        "down",
        {"quantization": neurons.quant["down"], "transposed": True},
    )
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-4, atol=1e-4 * float(mx.abs(y_ref).max()))


# -- errors, kernels ---------------------------------------------------------------------


def test_errors():
    rng = np.random.default_rng(5)
    c = Cache(rng, {"gate": ("q4", 64), "down": ("float32", 32)}, n_units=8)
    x, slots = mx.zeros((1, 64)), c.slots_for([1, 2])
    with pytest.raises(ValueError, match="no matrix 'up'"):
        gf.row_dot(x, c.rows, slots, c.layout, "up", None)
    with pytest.raises(ValueError, match="quantised rows need quant"):
        gf.row_dot(x, c.rows, slots, c.layout, "gate", None)
    with pytest.raises(ValueError, match="does not hold quantised rows"):
        gf.row_axpy(mx.zeros((1, 2)), c.rows, slots, c.layout, "down", {"bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="features"):
        gf.row_dot(mx.zeros((1, 63)), c.rows, slots, c.layout, "gate", c.quant["gate"])
    with pytest.raises(ValueError, match="weights per row"):
        gf.row_axpy(mx.zeros((1, 3)), c.rows, slots, c.layout, "down", None)
    with pytest.raises(TypeError):
        gf.row_dot(x.astype(mx.int32), c.rows, slots, c.layout, "gate", c.quant["gate"])
    if not mx.metal.is_available():
        with pytest.raises(RuntimeError, match="Metal not available"):
            gf.row_dot(x, c.rows, slots, c.layout, "gate", c.quant["gate"], use_metal=True)


def test_kernels_built_at_import():
    assert gm.kernel_path() is not None and gm.kernel_path().name == "gather_ffn.metal"
    assert gm._row_dot_kernel is not None and gm._row_axpy_kernel is not None
    assert set(gm.KERNEL_SOURCES) == {"header", "row_dot", "row_axpy"}
    assert "simd_sum" in gm.KERNEL_SOURCES["row_dot"]
    assert gm.available() == mx.metal.is_available()


# -- Metal vs MLX ops (Apple silicon only) -------------------------------------------------


@METAL
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("B", [1, 3])
def test_metal_matches_mlx_ops(kind, B):
    rng = np.random.default_rng(21 + B)
    d, n_out = 256, 96
    c = Cache(rng, {"gate": (kind, d), "up": ("q4", d), "down": (kind, n_out)}, n_units=50, alignment=4096)
    for xdtype in (mx.float32, mx.float16, mx.bfloat16):
        for units in (
            np.zeros(0, int),
            np.array([3]),
            rng.integers(0, 50, 5),
            rng.integers(0, 50, 37),
            rng.permutation(50),
        ):
            slots = c.slots_for(units)
            x = mx.array(rng.standard_normal((B, d)).astype(np.float32)).astype(xdtype)
            for name in ("gate", "up"):
                m = gf.row_dot(x, c.rows, slots, c.layout, name, c.quant[name], use_metal=True)
                o = gf.row_dot(x.astype(mx.float32), c.rows, slots, c.layout, name, c.quant[name], use_metal=False)
                assert m.dtype == xdtype
                xn = to_np(x)
                M = c.mag_of(name, units)
                assert_close(m, to_np(o), np.abs(xn) @ M.T, xdtype)
            w = mx.array(rng.standard_normal((B, len(units))).astype(np.float32)).astype(xdtype)
            m = gf.row_axpy(w, c.rows, slots, c.layout, "down", c.quant["down"], use_metal=True)
            o = gf.row_axpy(w.astype(mx.float32), c.rows, slots, c.layout, "down", c.quant["down"], use_metal=False)
            wn = to_np(w)
            M = c.mag_of("down", units)
            assert_close(m, to_np(o), np.abs(wn) @ M, xdtype)


@METAL
def test_metal_reads_a_cache_view_in_place():
    """The cache is a view into an over-allocated buffer (as UnitCache makes it): no copy, same result."""
    rng = np.random.default_rng(22)
    c = Cache(rng, {"fc1": ("q4", 128), "fc2": ("float16", 128)}, n_units=20)
    buf = mx.zeros((4096 + c.rows.size,), dtype=mx.uint8)
    rows = mx.concatenate([buf[:4096], c.rows.reshape(-1)])[4096:].reshape(c.rows.shape)
    slots = c.slots_for(rng.integers(0, 20, 6))
    x = mx.array(rng.standard_normal((1, 128)).astype(np.float32))
    a = gf.row_dot(x, rows, slots, c.layout, "fc1", c.quant["fc1"], use_metal=True)
    b = gf.row_dot(x, c.rows, slots, c.layout, "fc1", c.quant["fc1"], use_metal=False)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


# -- the kernel bodies executed as C++ on CPU threads ------------------------------------------

CXX = shutil.which("g++") or shutil.which("clang++")

# Stand-ins for the Metal builtins the bodies use. Every emulated GPU thread is a std::thread;
# all threads of one threadgroup run at once, threadgroups one after another, so `threadgroup`
# memory can be a function-static array. simd_sum and threadgroup_barrier are std::barriers.
STUBS = r"""
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
typedef _Float16 float16_t;
struct bfloat16_t {
    uint16_t bits;
    bfloat16_t() = default;
    explicit bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); bits = u >> 16; }
    explicit operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
#define device
#define constant
#define threadgroup static
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
struct SimdGroup { std::barrier<> bar; float vals[32]; explicit SimdGroup(int n) : bar(n) {} };
thread_local SimdGroup* tl_simd;
thread_local uint tl_lane;
thread_local std::barrier<>* tl_group;
float simd_sum(float v) {
    tl_simd->vals[tl_lane] = v;
    tl_simd->bar.arrive_and_wait();
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += tl_simd->vals[i];
    tl_simd->bar.arrive_and_wait();
    return s;
}
void threadgroup_barrier(mem_flags) { tl_group->arrive_and_wait(); }

// dispatchThreads(grid, group): non-uniform edge threadgroups as on Apple GPUs.
template <typename F>
void dispatch(uint3 grid, uint3 group, F kernel) {
    for (uint z0 = 0; z0 < grid.z; z0 += group.z)
    for (uint y0 = 0; y0 < grid.y; y0 += group.y)
    for (uint x0 = 0; x0 < grid.x; x0 += group.x) {
        uint3 size = {std::min(group.x, grid.x - x0), std::min(group.y, grid.y - y0), std::min(group.z, grid.z - z0)};
        uint n = size.x * size.y * size.z;
        std::barrier<> bar(n);
        std::vector<std::unique_ptr<SimdGroup>> simds;
        for (uint i = 0; i < n; i += 32) simds.emplace_back(new SimdGroup(std::min(32u, n - i)));
        std::vector<std::thread> threads;
        for (uint i = 0; i < n; i++) {
            uint3 local = {i % size.x, (i / size.x) % size.y, i / (size.x * size.y)};
            uint3 global = {x0 + local.x, y0 + local.y, z0 + local.z};
            threads.emplace_back([&, i, local, global] {
                tl_simd = simds[i / 32].get(); tl_lane = i % 32; tl_group = &bar;
                kernel(global, local, i % 32);
            });
        }
        for (auto& t : threads) t.join();
    }
}
"""

CTYPE = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}


def _cxx_kernel(which, m, xdtype):
    """One instantiation of a kernel body as a C++ function plus an extern "C" launcher."""
    src = gm.KERNEL_SOURCES[which]
    a = "x" if which == "row_dot" else "w"
    tmpl = dict(
        T=CTYPE[m.float_dtype],
        TO=CTYPE[xdtype],
        N=m.n,
        BITS=m.bits,
        GS=m.group_size,
        W_OFF=m.weight.offset,
        S_OFF=m.scales.offset if m.bits else 0,
        B_OFF=m.biases.offset if m.bits else 0,
        TC=gm._AXPY_TC,
        TJ=gm._AXPY_TJ,
    )
    consts = "\n".join(
        f"typedef {v} {k};" if k in ("T", "TO") else f"constexpr int {k} = {v};" for k, v in tmpl.items()
    )
    fn = f"{which}_{len(_CXX_CASES)}"
    if which == "row_dot":
        grid, group = "{32 * uint(k), uint(B), 1}", f"{{{gm._ROW_DOT_THREADGROUP}, 1, 1}}"
    else:
        cols = m.n // (32 // m.bits if m.bits else 1)
        groups = -(-cols // gm._AXPY_TC)
        grid, group = f"{{{groups * gm._AXPY_TC}, {gm._AXPY_TJ}, uint(B)}}", f"{{{gm._AXPY_TC}, {gm._AXPY_TJ}, 1}}"
    body = textwrap.indent(src, "    ")
    ct = CTYPE[xdtype]
    _CXX_CASES.append(fn)
    return f"""
namespace {fn}_ns {{
{consts}
void kernel(const {CTYPE[xdtype]}* {a}, const uint8_t* rows, const int* rows_shape, const int32_t* slots,
            const int* slots_shape, {CTYPE[xdtype]}* out, uint3 thread_position_in_grid,
            uint3 thread_position_in_threadgroup, uint thread_index_in_simdgroup) {{
{body}
}}
}}
extern "C" void {fn}(const void* a, const uint8_t* rows, int capacity, int stride, const int32_t* slots,
                     int k, int B, void* out) {{
    int rows_shape[2] = {{capacity, stride}};
    int slots_shape[1] = {{k}};
    dispatch({grid}, {group}, [&](uint3 g, uint3 l, uint lane) {{
        {fn}_ns::kernel((const {ct}*)a, rows, rows_shape, slots, slots_shape, ({ct}*)out, g, l, lane);
    }});
}}
"""


_CXX_CASES = []


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_kernel_bodies_emulated_on_cpu(tmp_path):
    rng = np.random.default_rng(31)
    d, n_out = 128, 96
    caches = [Cache(rng, {"gate": (k, d), "down": (k, n_out)}, n_units=40, alignment=512) for k in KINDS]
    xdtypes = [mx.float32, mx.float32, mx.float16, mx.float32, mx.bfloat16]
    _CXX_CASES.clear()
    pieces, cases = [gm.KERNEL_SOURCES["header"]], []
    for c, xdt in zip(caches, xdtypes):
        for which, name in (("row_dot", "gate"), ("row_axpy", "down")):
            m = row_matrix(
                c.layout, name, *(() if c.quant[name] is None else (c.quant[name]["bits"], c.quant[name]["group_size"]))
            )
            pieces.append(_cxx_kernel(which, m, xdt))
            cases.append((_CXX_CASES[-1], which, c, name, xdt))
    cpp = tmp_path / "gather_ffn_emulated.cpp"
    cpp.write_text(STUBS + "\n".join(pieces))
    lib = tmp_path / "gather_ffn_emulated.so"
    r = subprocess.run(
        [
            CXX,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            "-Wall",
            "-Wno-unused-variable",
            "-o",
            str(lib),
            str(cpp),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    so = ctypes.CDLL(str(lib))
    np_of = {mx.float32: np.float32, mx.float16: np.float16}
    for fn, which, c, name, xdt in cases:
        host = np.array(c.rows)
        for units, B in ((np.array([4]), 1), (rng.integers(0, 40, 5), 2), (rng.integers(0, 40, 33), 1)):
            k = len(units)
            slots = np.ascontiguousarray(c.slot_of_unit[units].astype(np.int32))
            slots[0] = -1 if k > 1 else slots[0]  # an invalid slot contributes 0
            W = c.rows_of(name, units)
            M = c.mag_of(name, units)
            if k > 1:
                W[0] = 0
            a_mx = mx.array(rng.standard_normal((B, d if which == "row_dot" else k)).astype(np.float32)).astype(xdt)
            if xdt == mx.bfloat16:
                a_raw = np.array(mx.view(a_mx, mx.uint16))
            else:
                a_raw = np.array(a_mx).astype(np_of[xdt])
            n_res = k if which == "row_dot" else c.truth[name].shape[1]
            out = np.zeros((B, n_res), dtype=a_raw.dtype)
            getattr(so, fn)(
                a_raw.ctypes.data_as(ctypes.c_void_p),
                host.ctypes.data_as(ctypes.c_void_p),
                host.shape[0],
                host.shape[1],
                slots.ctypes.data_as(ctypes.c_void_p),
                k,
                B,
                out.ctypes.data_as(ctypes.c_void_p),
            )
            res = to_np(mx.view(mx.array(out), mx.bfloat16)) if xdt == mx.bfloat16 else out.astype(np.float64)
            an = to_np(a_mx)
            ref, scale = (an @ W.T, np.abs(an) @ M.T) if which == "row_dot" else (an @ W, np.abs(an) @ M)
            bad = np.abs(res - ref) > TOL[xdt] * (scale + 1e-6)
            assert not bad.any(), (
                f"{fn} ({which} {name} {c.quant[name]} x {xdt}) k={k} B={B}: max err {np.abs(res - ref).max()}"
            )


# -- native CPU path (cpu_gemv) vs numpy ---------------------------------------------------


@pytest.fixture(params=["simd", "scalar"])
def native(request, monkeypatch):
    """The native CPU kernels, with their AVX2 loops (where the CPU has them) or the scalar ones;
    yields a dict counting the native calls, so each test proves it ran them."""
    from mlx_flash.compute import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("native CPU kernels not built or MLX not on the CPU")
    calls = {"row_dot": 0, "row_axpy": 0}
    for fn in calls:
        real = getattr(cpu_gemv, fn)

        def counted(*a, _real=real, _fn=fn, **k):
            calls[_fn] += 1
            return _real(*a, **k)

        monkeypatch.setattr(cpu_gemv, fn, counted)
    cpu_gemv._native.set_simd(request.param == "simd")
    yield calls
    cpu_gemv._native.set_simd(True)


@pytest.mark.parametrize("kinds", [("q4", "q8"), ("q8", "q4"), ("q2", "q4")])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.usefixtures("float_activations")
def test_native_cpu_rows_match_numpy(native, kinds, pad):
    """One float32 row (decode) against quantised cache rows: computed in place by the C kernels
    (every scale dtype, group size, unaligned offsets, repeated / unsorted / empty slot lists)."""
    rng = np.random.default_rng(len(kinds[0]) + 10 * pad)
    d, n_out = 256, 128
    c = Cache(rng, {"gate": (kinds[0], d), "up": (kinds[1], d), "down": (kinds[0], n_out)}, n_units=40, pad=pad)
    for case, units in unit_lists(rng, c.n_units).items():
        slots = c.slots_for(units)
        x = rng.standard_normal((1, 1, d)).astype(np.float32)
        for name in ("gate", "up"):
            out = gf.row_dot(mx.array(x), c.rows, slots, c.layout, name, c.quant[name], use_metal=False)
            assert out.shape == (1, 1, len(units)), case
            W, M = c.rows_of(name, units), c.mag_of(name, units)
            assert_close(out, x @ W.T, np.abs(x) @ M.T, mx.float32)
        w = rng.standard_normal((1, len(units))).astype(np.float32)
        out = gf.row_axpy(mx.array(w), c.rows, slots, c.layout, "down", c.quant["down"], use_metal=False)
        assert out.shape == (1, n_out), case
        W, M = c.rows_of("down", units), c.mag_of("down", units)
        assert_close(out, w @ W, np.abs(w) @ M, mx.float32)
    assert native["row_dot"] >= 6 and native["row_axpy"] >= 3  # the empty case returns before any kernel


def test_native_cpu_path_only_for_few_float32_rows(native):
    """More rows than cpu_gemv.NATIVE_ROWS (prompts) and float16 inputs keep MLX's ops; one row (a decode step) and
    a verification pass's few rows run natively."""
    rng = np.random.default_rng(5)
    c = Cache(rng, {"gate": ("q4", 64), "up": ("q4", 64), "down": ("q8", 64)}, n_units=8)
    slots = c.slots_for(np.arange(8))
    from mlx_flash.compute.cpu_gemv import NATIVE_ROWS

    many = NATIVE_ROWS + 1
    gf.row_dot(
        mx.array(rng.standard_normal((many, 64)).astype(np.float32)), c.rows, slots, c.layout, "gate", c.quant["gate"]
    )
    gf.row_dot(
        mx.array(rng.standard_normal((1, 64))).astype(mx.float16), c.rows, slots, c.layout, "gate", c.quant["gate"]
    )
    assert native["row_dot"] == 0
    gf.row_dot(
        mx.array(rng.standard_normal((1, 64)).astype(np.float32)), c.rows, slots, c.layout, "gate", c.quant["gate"]
    )
    assert native["row_dot"] == 1
