"""The CPU facts that shaped the CPU path (BENCHMARKS.md "CPU kernels"), measured.

    python benchmarks/cpu_facts.py [--rounds 3] [--repeats 5] [--json out.json]

1. gemm 64x4096 @ 4096x4096 float32 with the reference BLAS the `mlx[cpu]` wheel bundles (in a
   subprocess with MLX_FLASH_OPENBLAS=0, so mlx_flash does not load OpenBLAS) and with OpenBLAS.
2. quantized_matmul of one row against a 4-bit 1536x576 matrix (SmolLM2's gate), x and scales in
   float16 / float32.
3. The same matrix: quantized_matmul vs dequantize + float32 gemm, 1 / 16 / 128 rows.
4. One row: MLX's quantized_matmul vs the native kernel (bench_cpu_gemv.mlx_vs_native).

Each figure is the median over --rounds of the median of --repeats calls; within a round every
operation runs once, so load changes hit them all.
"""

import argparse
import json
import os
import subprocess
import sys

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core, unless MLX_FLASH_OPENBLAS=0)
from mlx_flash import blas
from mlx_flash.tools.bench_io import machine_info

import mlx.core as mx
import numpy as np
from bench_cpu_gemv import mlx_vs_native, quantized  # noqa: E402  (this script's directory is on sys.path)
from bench_gather_ffn import median_ms  # noqa: E402

GS, BITS, ROWS, N = 64, 4, 1536, 576  # SmolLM2's gate, per neuron


def gemm(repeats):
    a, b = mx.random.normal((64, 4096)), mx.random.normal((4096, 4096))
    mx.eval(a, b)
    return median_ms(lambda: a @ b, repeats)


def reference_gemm(repeats) -> float:
    """gemm() in a process where mlx_flash left MLX's bundled reference BLAS in place."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["MLX_FLASH_OPENBLAS"] = "0"
    out = subprocess.run(
        [sys.executable, __file__, "--reference-gemm", "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)["ms"]


def qmm(x_dtype, scale_dtype, m=1):
    wq, s, b = quantized(ROWS, N, BITS, scale_dtype, GS)
    x = mx.random.normal((m, N)).astype(x_dtype)
    mx.eval(x)
    return lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GS, bits=BITS)


def dequant_gemm(m):
    wq, s, b = quantized(ROWS, N, BITS, mx.float32, GS)
    x = mx.random.normal((m, N))
    mx.eval(x)
    return lambda: x @ mx.dequantize(wq, s, b, group_size=GS, bits=BITS).T


def measure(rounds, repeats):
    ops = {"gemm openblas": lambda: gemm(repeats)}
    ops["gemm reference"] = lambda: reference_gemm(max(1, repeats // 2))
    for xd, sd in (("float16", "float16"), ("float32", "float16"), ("float32", "float32")):
        fn = qmm(getattr(mx, xd), getattr(mx, sd))
        ops[f"qmm x {xd} scales {sd}"] = lambda fn=fn: median_ms(fn, repeats)
    for m in (1, 16, 128):
        q, d = qmm(mx.float32, mx.float32, m), dequant_gemm(m)
        ops[f"qmm {m} rows"] = lambda q=q: median_ms(q, repeats)
        ops[f"dequantize + gemm {m} rows"] = lambda d=d: median_ms(d, repeats)
    times = {k: [] for k in ops}
    for _ in range(rounds):
        for k, fn in ops.items():
            times[k].append(fn())
    res = {k: float(np.median(v)) for k, v in times.items()}
    wq, s, b = quantized(ROWS, N, BITS, mx.float16, GS)  # scales as the converted models store them
    res["one row mlx"], res["one row native"] = mlx_vs_native(wq, s, b, BITS, True, GS, rounds, repeats)
    return res


def table(r) -> str:
    m = (1, 16, 128)
    lines = [
        "| operation | time |",
        "|---|---|",
        f"| gemm 64x4096 @ 4096x4096 f32, reference BLAS / OpenBLAS | {r['gemm reference']:.0f} ms / "
        f"{r['gemm openblas']:.1f} ms ({r['gemm reference'] / r['gemm openblas']:.0f}x) |",
        "| quantized_matmul 1x576 @ 4-bit 1536x576: x f16 + scales f16 / x f32 + scales f16 / x f32 + scales f32 | "
        + " / ".join(
            f"{r[k]:.2f}"
            for k in ("qmm x float16 scales float16", "qmm x float32 scales float16", "qmm x float32 scales float32")
        )
        + " ms |",
        "| 4-bit 1536x576 (x, scales f32): quantized_matmul vs dequantize + f32 gemm, 1 / 16 / 128 rows | "
        + " / ".join(f"{r[f'qmm {k} rows']:.2f} vs {r[f'dequantize + gemm {k} rows']:.2f}" for k in m)
        + " ms |",
        "| 4-bit 1536x576 (scales f16), one row: MLX quantized_matmul vs the native kernel | "
        f"{r['one row mlx']:.2f} vs {r['one row native']:.2f} ms |",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--reference-gemm", action="store_true", help=argparse.SUPPRESS)  # the subprocess
    args = p.parse_args()
    if args.reference_gemm:
        path = blas._openblas_path()
        assert blas.status.startswith("disabled") and not (path and blas._loaded(path)), blas.status
        print(json.dumps({"ms": gemm(args.repeats)}))
        return
    info = machine_info(os.getcwd())
    print(
        f"{info.get('cpu')}, {info['cores']} cores; mlx {info['mlx']}, BLAS: {info['blas']}, "
        f"native matvecs: {info['cpu_matvecs']}"
    )
    load = [os.getloadavg()[0]]
    res = measure(args.rounds, args.repeats)
    load.append(os.getloadavg()[0])
    print(f"load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f}\n")
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(["python benchmarks/cpu_facts.py"] + sys.argv[1:]),
                    "machine": info,
                    "load_average": load,
                    "rounds": args.rounds,
                    "repeats": args.repeats,
                    "ms": res,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
