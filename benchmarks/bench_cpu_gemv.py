"""Native CPU matvecs (cpu_gemv) against MLX's CPU quantized_matmul, in one run.

    python benchmarks/bench_cpu_gemv.py [--decode] [--synthetic llama-7b] [--memory-budget 50%] \
        [--tokens 6] [--prompt-tokens 8] [--json out.json] [--plot out.png]

1. One-row products of the shapes the models use (SmolLM2-135M, LLaMA-7B), each way round:
   MLX's op and the native kernel, medians of interleaved repeats.
2. --decode: mlx_flash.bench's hybrid / all / mlx-lm rows with the native kernels off, then on
   (the same model, budget and trace).
"""

import argparse
import json
import platform
import sys

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash import bench
from mlx_flash.compute import cpu_gemv

import mlx.core as mx
import numpy as np
from bench_gather_ffn import median_ms  # noqa: E402  (this script's directory is on sys.path)

SHAPES = [  # (name, rows, n, bits, scale dtype): rows of n values each
    ("SmolLM2 q_proj", 576, 576, 4, mx.float32),
    ("SmolLM2 gate (per neuron)", 1536, 576, 4, mx.float16),
    ("SmolLM2 down (per neuron)", 1536, 576, 8, mx.float16),
    ("SmolLM2 tied head", 49152, 576, 8, mx.float32),
    ("7B q_proj", 4096, 4096, 4, mx.float32),
    ("7B gate (per neuron)", 11008, 4096, 4, mx.float16),
    ("7B down (per neuron)", 11008, 4096, 8, mx.float16),
]


def quantized(rows, n, bits, scale_dtype, group_size=64):
    """A random rows x n matrix quantised to bits, its scales and biases in scale_dtype."""
    wq, s, b = mx.quantize(mx.random.normal((rows, n)), group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    mx.eval(wq, s, b)
    return wq, s, b


def mlx_vs_native(wq, s, b, bits, transpose, group_size=64, rounds=3, repeats=5):
    """(MLX ms, native ms) for one float32 row against wq: medians of rounds x repeats, interleaved."""
    sf, bf = s.astype(mx.float32), b.astype(mx.float32)  # MLX wants the scales in x's dtype
    x = mx.random.normal((1, wq.shape[-1] * 32 // bits if transpose else wq.shape[0]))
    mx.eval(sf, bf, x)

    def mlx_op():
        return mx.quantized_matmul(x, wq, sf, bf, transpose=transpose, group_size=group_size, bits=bits)

    def native():
        return cpu_gemv.matvec(x, wq, s, b, group_size, bits, transpose)

    a, c = [], []
    for _ in range(rounds):  # interleaved, so load changes hit both
        a.append(median_ms(mlx_op, repeats))
        c.append(median_ms(native, repeats))
    return float(np.median(a)), float(np.median(c))


def matvecs(group_size=64):
    rows = []
    for name, r, n, bits, sdt in SHAPES:
        wq, s, b = quantized(r, n, bits, sdt, group_size)
        for transpose, what in ((True, "x @ W^T (row_dot)"), (False, "c @ W (row_axpy)")):
            a, c = mlx_vs_native(wq, s, b, bits, transpose, group_size)
            rows.append(
                {
                    "matrix": name,
                    "product": what,
                    "bits": bits,
                    "rows": r,
                    "n": n,
                    "mlx_ms": a,
                    "native_ms": c,
                    "speedup": a / c,
                    "native_gweights_per_s": r * n / c / 1e6,
                }
            )
    return rows


def decode(args):
    argv = [
        "--memory-budget",
        args.memory_budget,
        "--tokens",
        str(args.tokens),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--configs",
        args.configs,
        "--no-fio",
    ]
    argv += ["--synthetic", args.synthetic] if args.synthetic else []
    out = {}
    for on in (False, True):
        cpu_gemv.enabled = on
        out["native" if on else "mlx"] = bench.main(argv)
    cpu_gemv.enabled = True
    return out


def side_by_side(decode_result) -> dict:
    """Both decode runs as one bench result, each configuration twice (MLX, native), for bench.plot."""
    configs = {}
    for name in decode_result["mlx"]["configs"]:
        for key, label in (("mlx", "MLX"), ("native", "native")):
            r = decode_result[key]["configs"].get(name, {})
            if "total_ms" in r:
                configs[f"{name}\n{label}"] = r
    return dict(decode_result["native"], configs=configs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", action="store_true")
    p.add_argument("--synthetic", default=None)
    p.add_argument("--memory-budget", default="50%")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--configs", default="hybrid,all,mlx-lm")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="--decode: latency breakdown, MLX's matvecs beside the native ones")
    args = p.parse_args()
    result = {
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "native": cpu_gemv.info(),
    }
    result["matvecs"] = matvecs()
    print("| matrix | product | bits | MLX ms | native ms | speed-up | native G weights/s |")
    print("|---|---|---|---|---|---|---|")
    for r in result["matvecs"]:
        print(
            f"| {r['matrix']} ({r['rows']}x{r['n']}) | {r['product']} | {r['bits']} | {r['mlx_ms']:.2f} | "
            f"{r['native_ms']:.2f} | {r['speedup']:.1f}x | {r['native_gweights_per_s']:.1f} |"
        )
    if args.decode:
        result["decode"] = decode(args)
        print(
            "\n| config | total ms, MLX kernels | total ms, native | speed-up | "
            "compute ms, MLX / native | I/O ms, MLX / native |"
        )
        print("|---|---|---|---|---|---|")
        m, n = result["decode"]["mlx"]["configs"], result["decode"]["native"]["configs"]
        for name in m:
            if "total_ms" not in m[name] or "total_ms" not in n.get(name, {}):
                continue
            print(
                f"| {name} | {m[name]['total_ms']:.0f} | {n[name]['total_ms']:.0f} | "
                f"{m[name]['total_ms'] / n[name]['total_ms']:.2f}x | {m[name]['compute_ms']:.0f} / "
                f"{n[name]['compute_ms']:.0f} | {m[name]['io_ms']:.0f} / {n[name]['io_ms']:.0f} |"
            )
        for k in ("mlx", "native"):
            print(f"targets ({k}): {json.dumps(result['decode'][k]['targets'])}")
        if args.plot:
            bench.plot(side_by_side(result["decode"]), args.plot, "decode latency: MLX's matvecs vs native")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
