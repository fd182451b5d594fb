"""A dense FFN layer held whole in a neuron cache, one decode row: the three native products (row_dot_pairs ->
glu_pairs -> block_axpy) against cpu_gemv.ffn_glu (one pass over each unit's rows), same bits, alternated.

    python benchmarks/bench_ffn_glu.py [--units 11008] [--d 4096] [--layers 8] [--rounds 5] [--json OUT]

The cache rows are laid out as convert writes a unit (gate codes and scales, up codes and scales, down codes; Q4_0,
the down rows' block scales resident) with random bytes; `--layers` of them, taken in turn, so that each call reads
its rows from memory rather than the cache. Prints ms per layer (median over rounds) and the unit bytes per second
it streamed.
"""

import argparse
import json
import statistics
import time

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.compute import cpu_gemv
from mlx_flash.engine.units import REDUCTION_UNITS
from mlx_flash.tools.bench_io import machine_info

import mlx.core as mx
import numpy as np


def layer(rng, units: int, d: int):
    """One layer's cache rows [units, stride] and its gate, up and down arguments."""
    codes, scales = d // 2, d // 32 * 2
    stride = 2 * (codes + scales) + codes
    buf = rng.integers(0, 256, (units, stride), dtype=np.uint8)
    for off in (codes, 2 * codes + scales):  # each row's float16 scales: small, finite
        buf[:, off : off + scales] = rng.uniform(0.001, 0.01, (units, scales // 2)).astype(np.float16).view(np.uint8)
    gate, up = (
        cpu_gemv.QuantRows(buf, w, stride, buf, w + codes, stride, buf, w + codes, stride, d, 4, 32, mx.float16, True)
        for w in (0, codes + scales)
    )
    S = mx.array(rng.uniform(0.001, 0.01, (units // 32, d)).astype(np.float16))
    slots = np.arange(units, dtype=np.int32)  # (a cache filled in order)
    down = (buf, 2 * (codes + scales), stride, slots, slots // 32, S, None, d, 4)
    return buf, gate, up, down


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=11008)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cpu_gemv.set_int8_activations(True)
    rng = np.random.default_rng(0)
    layers = [layer(rng, args.units, args.d) for _ in range(args.layers)]
    x = rng.standard_normal((1, args.d)).astype(np.float32)
    dst = (np.arange(args.units) // REDUCTION_UNITS).astype(np.int32)
    n_out = int(dst[-1]) + 1

    def three(buf, gate, up, down):
        h = cpu_gemv.glu_pairs(cpu_gemv.row_dot_pairs(x, gate, up, down[3]))
        return cpu_gemv.block_axpy(h, *down, dst, n_out)

    def fused(buf, gate, up, down):
        return cpu_gemv.ffn_glu(x, gate, up, down[3], down, dst, n_out)

    for lay in layers:  # the same bits
        assert np.array_equal(three(*lay), fused(*lay))
    ms = {"three products": [], "ffn_glu": []}
    for _ in range(args.rounds):
        for name, f in (("three products", three), ("ffn_glu", fused)):
            t = time.perf_counter()
            for lay in layers:
                f(*lay)
            ms[name].append(1e3 * (time.perf_counter() - t) / len(layers))
    unit_bytes = layers[0][0].nbytes
    out = {"units": args.units, "d": args.d, "layers": args.layers, "ms_per_layer": ms, "machine": machine_info(".")}
    for name, v in ms.items():
        med = statistics.median(v)
        out[f"{name} median ms"] = med
        print(f"{name}: {med:.2f} ms a layer ({', '.join(f'{t:.2f}' for t in v)}), {unit_bytes / med / 1e6:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
