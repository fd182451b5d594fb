"""What a batch costs MLX's quantised products: one product of M rows against M = 1, on MLX's default device, at a
model's shapes (SmolLM2-135M's by default: 576 x 1536, 4-bit, group 32, float32 rows as the CPU path runs them).

    python benchmarks/mlx_rows.py [--rows 1,8] [--out benchmarks/results/mlx_rows.json]

A batch shares the weights' reads and each row's dispatch; where a product's time grows with its rows (the
arithmetic bound), batching gains little however few operations it builds.
"""

import argparse  # noqa: I001  (mlx_flash before mlx.core)
import json
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx

from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.peers_systems import versions

HERE = Path(__file__).resolve().parent
SHAPES = {"gate/up": (576, 1536), "down": (1536, 576)}  # SmolLM2-135M's FFN (in, out)


def timed(f, repeats: int = 200) -> float:
    for _ in range(10):
        mx.eval(f())
    t = time.perf_counter()
    for _ in range(repeats):
        mx.eval(f())
    return (time.perf_counter() - t) / repeats


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--out", type=Path, default=HERE / "results" / "mlx_rows.json")
    args = p.parse_args()
    out = {"device": str(mx.default_device()), "machine": machine_info(str(HERE)), "versions": versions(), "rows": []}
    for name, (n_in, n_out) in SHAPES.items():
        w = mx.random.normal((n_out, n_in))
        q, scales, biases = mx.quantize(w, group_size=32, bits=4)
        for m in map(int, args.rows.split(",")):
            x = mx.random.normal((m, n_in))
            s = timed(lambda: mx.quantized_matmul(x, q, scales, biases, transpose=True, group_size=32, bits=4))
            out["rows"].append({"product": name, "rows": m, "us": s * 1e6})
            print(json.dumps(out["rows"][-1]), flush=True)
    for r in out["rows"]:
        one = next(o for o in out["rows"] if o["product"] == r["product"] and o["rows"] == 1)
        r["vs_one_row"] = r["us"] / one["us"]
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
