"""Micro-benchmark: the sparse FFN from cache rows (gather_ffn, MLX-ops path) vs the dense resident FFN.

    python benchmarks/bench_gather_ffn.py [--repeats 7] [--quick] [--only '7B 4096x11008 q4'] [--mallopt]

For each shape and storage type, a cache holding every unit of one layer (GLU: gate, up,
down rows per neuron, packed by flash_format.BundleLayout, stride aligned to 4096) and x of
one token (float32). The sparse FFN over a random active set of k = fraction * n units is

    h = silu(row_dot(x, gate)) * row_dot(x, up);  y = row_axpy(h, down)

(mx.take of the active rows' columns + matmuls / quantized_matmuls, use_metal=False), and
the dense FFN is ffn.ffn_forward over all n units held resident in the same dtype (as
ResidentFFN computes it). Times are the median of --repeats evaluations after a warm-up;
"gather" is the mx.take part of the sparse FFN alone. Not a test: numbers depend on the
machine (this was written for a 2-core x86 CPU without Metal).

--mallopt raises glibc's mmap threshold first: MLX's CPU allocator on Linux hands large
buffers back to the OS, so every big temporary (gathered rows, float16 -> float32 copies)
is page-faulted in again on each call; with the flag they are recycled by malloc.
"""

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_flash  # noqa: E402,F401  (loads OpenBLAS before mlx.core)
from mlx_flash.compute import backends as gf  # noqa: E402
from mlx_flash.compute.ffn import ACTIVATIONS, ffn_forward  # noqa: E402
from mlx_flash.compute.ops import gather  # noqa: E402
from mlx_flash.format.layout import BundleLayout  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

SHAPES = [
    # label, d_model, n_neurons, storage, quantisation
    ("SmolLM2 576x1536", 576, 1536, "float32", None),
    ("SmolLM2 576x1536", 576, 1536, "q4", {"bits": 4, "group_size": 64}),
    ("7B 4096x11008", 4096, 11008, "float16", None),
    ("7B 4096x11008", 4096, 11008, "q4", {"bits": 4, "group_size": 64}),
]
FRACTIONS = (0.10, 0.25, 0.50, 1.00)


def layer(d, n, storage, quant, seed=0):
    """One GLU layer's stored rows {component: [n, ...]} (gate, up, down rows per neuron)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name in ("gate", "up", "down"):
        w = mx.array((rng.standard_normal((n, d), dtype=np.float32) * 0.02))
        if quant is None:
            arrays[f"{name}.weight"] = w.astype(getattr(mx, storage))
        else:
            q, s, b = mx.quantize(w, quant["group_size"], quant["bits"])
            arrays.update(
                {f"{name}.weight": q, f"{name}.scales": s.astype(mx.float16), f"{name}.biases": b.astype(mx.float16)}
            )
        mx.eval(arrays)
    return arrays


def median_ms(fn, repeats):
    mx.eval(fn())  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def mallopt():
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="SmolLM2 shapes only")
    p.add_argument(
        "--only", default="", help="run the shapes whose 'label storage' contains this, e.g. '7B 4096x11008 q4'"
    )
    p.add_argument("--mallopt", action="store_true", help="keep large buffers in malloc (see the module doc)")
    args = p.parse_args()
    if args.mallopt:
        mallopt()
    silu = ACTIVATIONS["silu"]
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, metal {mx.metal.is_available()}, "
        f"repeats {args.repeats}, mallopt {args.mallopt}"
    )
    print(
        f"{'shape':<18} {'storage':<8} {'active':>6} {'k':>6} {'gather ms':>10} {'sparse ms':>10} "
        f"{'dense ms':>9} {'sparse/dense':>12}"
    )
    for label, d, n, storage, quant in SHAPES:
        if (args.quick and d > 1000) or args.only not in f"{label} {storage}":
            continue
        arrays = layer(d, n, storage, quant)
        layout = BundleLayout.from_arrays(arrays, 4096)
        rows = mx.array(layout.pack(arrays))
        ffn = {
            "kind": "glu",
            "activation": "silu",
            "matrices": {m: {"quantization": quant, "transposed": m == "down"} for m in ("gate", "up", "down")},
        }
        x = mx.array(np.random.default_rng(1).standard_normal((1, d), dtype=np.float32))
        dense = median_ms(lambda: ffn_forward(x, arrays, ffn), args.repeats)
        cache_slots = np.random.default_rng(2).permutation(n).astype(np.int32)  # unit -> cache slot
        for f in FRACTIONS:
            k = int(round(f * n))
            units = np.sort(np.random.default_rng(3).choice(n, k, replace=False))
            slots = mx.array(cache_slots[units])

            def sparse():
                g = gf.row_dot(x, rows, slots, layout, "gate", quant, use_metal=False)
                u = gf.row_dot(x, rows, slots, layout, "up", quant, use_metal=False)
                return gf.row_axpy(silu(g) * u, rows, slots, layout, "down", quant, use_metal=False)

            def take_rows():
                return [gather(rows, slots, c) for c in layout.components]

            t_sparse = median_ms(sparse, args.repeats)
            t_gather = median_ms(take_rows, args.repeats)
            print(
                f"{label:<18} {storage:<8} {f:>6.0%} {k:>6} {t_gather:>10.2f} {t_sparse:>10.2f} {dense:>9.2f} "
                f"{t_sparse / dense:>12.2f}"
            )
        if storage == "float16":  # the dense FFN with the weights already float32 (no per-call cast)
            a32 = {k: v.astype(mx.float32) for k, v in layer(d, n, storage, quant).items()}
            mx.eval(a32)
            t = median_ms(lambda: ffn_forward(x, a32, ffn), args.repeats)
            print(
                f"{label:<18} {'(f32)':<8} {'dense':>6} {n:>6} {'':>10} {'':>10} {t:>9.2f}   "
                "weights resident as float32"
            )
            del a32


if __name__ == "__main__":
    main()
