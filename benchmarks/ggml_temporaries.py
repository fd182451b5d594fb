"""MLX's temporaries for experts of GGML blocks: the peak of MLX's memory over one call of the ops MLX's path runs
on a decode step's experts (8 experts' gathered blocks of a Qwen3-30B-A3B matrix, 768 x 2048): the affine types
repacked (`ggml.to_affine`) into MLX's quantised product, the others dequantised into MLX's float product, float32
activations. Bytes a weight, against `ggml.TEMPORARY_BYTES` (what the plan counts).

    python benchmarks/ggml_temporaries.py [--json benchmarks/results/ggml_temporaries.json]
"""

import argparse
import json

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.format import ggml
from mlx_flash.tools.bench_io import machine_info

import mlx.core as mx
import numpy as np

EXPERTS, OUT, N = 8, 768, 2048


def product(raw: mx.array, kind: str, x: mx.array) -> mx.array:
    idx = mx.arange(len(raw), dtype=mx.uint32)
    if kind in ggml.AFFINE:
        w, s, b, bits = ggml.to_affine(raw, kind)
        return mx.gather_qmm(x, w, s, b, rhs_indices=idx, transpose=True, group_size=32, bits=bits)
    return mx.gather_mm(x, ggml.dequantize(raw, kind).swapaxes(-1, -2), rhs_indices=idx)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    x = mx.random.normal((EXPERTS, 1, N))
    rows = []
    for kind in ggml.BLOCKS:
        raw = mx.array(np.stack([ggml.random_rows(rng, kind, OUT, N) for _ in range(EXPERTS)]))
        mx.eval(raw, x, product(raw, kind, x))  # (compiled kernels built first)
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(product(raw, kind, x))
        per = (mx.get_peak_memory() - base) / (EXPERTS * OUT * N)
        rows.append({"type": kind, "bytes_a_weight": per, "planned": ggml.TEMPORARY_BYTES[kind]})
        print(f"{kind}: {per:.2f} B a weight (the plan counts {ggml.TEMPORARY_BYTES[kind]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info("."), "experts": EXPERTS, "shape": [OUT, N], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
