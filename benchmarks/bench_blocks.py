"""The native kernels on one expert of the Qwen3-30B-A3B shape (gate and up 768 x 2048, down 2048 x 768), one
position, one thread: GGML blocks as stored (cpu_gemv.block_dot, each type) against the affine rows a copied
directory holds (row_dot_pairs and row_dot on MLX's 4-bit codes with float16 scales, Q4_0's symmetric form).

    OMP_NUM_THREADS=1 python benchmarks/bench_blocks.py [--json benchmarks/results/bench_blocks.json]

Best of 5 repeats of 100 experts each; weights a second (3 x 768 x 2048 per expert) and bytes a second of the rows.
"""

import argparse
import json
import sys
import time

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.compute import cpu_gemv
from mlx_flash.format.ggml import BLOCKS, random_rows, row_bytes
from mlx_flash.tools.bench_io import machine_info

import mlx.core as mx
import numpy as np

D, F = 2048, 768  # Qwen3-30B-A3B: hidden size, an expert's width


def timed(fn, repeats: int = 5, n: int = 100) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    threads = cpu_gemv.info()["threads"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, D)).astype(np.float32)
    rows = []
    for kind in BLOCKS:
        g, u, d = random_rows(rng, kind, F, D), random_rows(rng, kind, F, D), random_rows(rng, kind, D, F)
        unit = np.concatenate([g.reshape(-1), u.reshape(-1), d.reshape(-1)])[None]

        def expert(kind=kind, unit=unit, gb=g.size):
            gu = cpu_gemv.block_dot(x, unit, (0, gb), row_bytes(kind, D), kind, D, k=F)
            return cpu_gemv.block_dot(cpu_gemv.glu_pairs(gu), unit, (2 * gb,), row_bytes(kind, F), kind, F, k=D)

        rows.append({"rows": f"{kind} blocks (block_dot)", "s": timed(expert), "bytes": unit.size})
    gate, down = (mx.quantize(mx.random.normal(s), group_size=32, bits=4) for s in ((F, D), (D, F)))
    g = cpu_gemv.QuantRows.of_matrix(gate[0], gate[1].astype(mx.float16), None, 32, 4)
    dn = cpu_gemv.QuantRows.of_matrix(down[0], down[1].astype(mx.float16), None, 32, 4)
    mx.eval(g.w, g.s, dn.w, dn.s)

    def affine():
        return cpu_gemv.row_dot(cpu_gemv.glu_pairs(cpu_gemv.row_dot_pairs(x, g, g, k=F)), dn, k=D)

    rows.append(
        {"rows": "MLX affine 4-bit, float16 scales (row_dot)", "s": timed(affine), "bytes": 3 * F * D * 9 // 16}
    )
    print(f"| rows | one expert | G weights/s | GB/s | ({threads} thread(s), int8 activations) |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["gweights_s"], r["gb_s"] = 3 * D * F / r["s"] / 1e9, r["bytes"] / r["s"] / 1e9
        print(f"| {r['rows']} | {1e6 * r['s']:.0f} us | {r['gweights_s']:.1f} | {r['gb_s']:.1f} | |")
    if args.json:
        out = {"command": " ".join(["python", *sys.argv]), "machine": machine_info("."), "info": cpu_gemv.info()}
        with open(args.json, "w") as f:
            json.dump({**out, "threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
