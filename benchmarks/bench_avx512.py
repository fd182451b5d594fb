"""cpu_gemv's AVX-512 loops against its AVX2 / VNNI ones (the same bits), on a LLaMA-7B layer's shapes.

    python benchmarks/bench_avx512.py [--threads 1,2] [--positions 1] [--rounds 6] [--only NAME] [--json OUT]
                                      [--decode FLASH_DIR --tokens 16 --decode-rounds 2]

1. Per thread count (a fresh process each: OpenMP reads OMP_NUM_THREADS once), the products of a decode step, Q4_0-like
   (4 bits, group size 32, float16 scales, symmetric), rows read from DRAM: each matrix is one of several copies
   (together past the L3), in turn, as a decode step's layers are. The two loops alternate (set_avx512), medians of
   `rounds` x copies calls each:
     row_dot    4096 x 4096   an attention projection, int8 activations (contiguous rows)
     row_dot   11008 x 4096   gate (or up): neuron rows 6656 bytes apart, as the flash layout stores them
     block_axpy 11008 x 4096  down with resident group scales (convert's GGUF layout)
     row_axpy  11008 x 4096   down with per-row scales (MLX-converted models)
     row_dot   32000 x 4096   the LM head
2. --decode: whole resident decode steps of a flash directory (benchmarks/resident_decode.py's measurement, a fresh
   process each), MLX_FLASH_AVX512=0 and 1 alternating.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.compute import cpu_gemv

import mlx.core as mx
import numpy as np

D, F, VOCAB, ROW = 4096, 11008, 32000, 6656  # neuron row: gate codes + scales, up codes + scales, down codes
COPIES = 8  # of each matrix: 8 x 73 MB of neuron rows, 8 x 9.4 MB of projections (past the L3: 32 MB here)


def matrices(rng):
    """The layer's buffers: COPIES of each. Scales are float16 in [0.001, 0.01]."""

    def scales(*shape):
        return rng.uniform(0.001, 0.01, shape).astype(np.float16)

    proj, neurons = [], []
    for _ in range(COPIES):
        w, s = rng.integers(0, 256, (D, D // 2), dtype=np.uint8), scales(D, D // 32)
        proj.append(cpu_gemv.QuantRows(w, 0, D // 2, s, 0, D // 16, s, 0, D // 16, D, 4, 32, mx.float16, True))
        buf = rng.integers(0, 256, (F, ROW), dtype=np.uint8)
        buf[:, 2048:2304] = scales(F, D // 32).view(np.uint8)  # gate's scales after its codes, as the layout's
        buf[:, 4352:4608] = scales(F, D // 32).view(np.uint8)
        neurons.append((buf, mx.array(scales(F // 32, D))))
    head_w, head_s = rng.integers(0, 256, (VOCAB, D // 2), dtype=np.uint8), scales(VOCAB, D // 32)
    head = cpu_gemv.QuantRows(head_w, 0, D // 2, head_s, 0, D // 16, head_s, 0, D // 16, D, 4, 32, mx.float16, True)
    return proj, neurons, head


def products(rng, m):
    """name -> (f(i): the product on copy i, GB it reads)."""
    proj, neurons, head = matrices(rng)
    x, c = rng.standard_normal((m, D)).astype(np.float32), rng.standard_normal((m, F)).astype(np.float32)
    blocks = (np.arange(F) // 32).astype(np.int32)

    def rows(i, codes, scales):
        buf = neurons[i][0]
        return cpu_gemv.QuantRows(buf, codes, ROW, buf, scales, ROW, buf, scales, ROW, D, 4, 32, mx.float16, True)

    gate, down = [rows(i, 0, 2048) for i in range(COPIES)], [rows(i, 4608, 2048) for i in range(COPIES)]
    dot_gb, axpy_gb = F * (D // 2 + D // 16) / 1e9, F * D / 2 / 1e9
    return {
        "row_dot 4096x4096 (attention projection)": (lambda i: cpu_gemv.row_dot(x, proj[i], k=D), D * 2304 / 1e9),
        "row_dot 11008x4096 (gate, neuron rows)": (lambda i: cpu_gemv.row_dot(x, gate[i], k=F), dot_gb),
        "block_axpy 11008x4096 (down, resident scales)": (
            lambda i: cpu_gemv.block_axpy(c, neurons[i][0], 4608, ROW, None, blocks, neurons[i][1], None, D, 4),
            axpy_gb + F // 32 * D * 2 / 1e9,
        ),
        "row_axpy 11008x4096 (down, per-row scales)": (lambda i: cpu_gemv.row_axpy(c, down[i]), dot_gb),
        "row_dot 32000x4096 (LM head)": (lambda i: cpu_gemv.row_dot(x, head, k=VOCAB), VOCAB * 2304 / 1e9),
    }


def kernels(m: int, rounds: int, only: str = "") -> dict:
    """In this process: {product: {"avx2_ms", "avx512_ms", "speedup", "avx2_gb_per_s", "avx512_gb_per_s"}} for the
    products whose name contains `only`."""
    cpu_gemv.set_int8_activations(True)
    out = {}
    for name, (f, gb) in products(np.random.default_rng(0), m).items():
        if only not in name:
            continue
        times = {False: [], True: []}
        for on in (False, True):  # warm-up: every copy once
            cpu_gemv.set_avx512(on)
            for i in range(COPIES):
                f(i)
        for _ in range(rounds):
            for on in (False, True):
                cpu_gemv.set_avx512(on)
                for i in range(COPIES):
                    t = time.perf_counter()
                    f(i)
                    times[on].append(time.perf_counter() - t)
        a, b = (statistics.median(times[on]) for on in (False, True))
        out[name] = {"avx2_ms": 1e3 * a, "avx512_ms": 1e3 * b, "speedup": a / b, "avx2_gb_per_s": gb / a}
        out[name]["avx512_gb_per_s"] = gb / b
    cpu_gemv.set_avx512(True)
    return out


def run_kernels(threads: int, m: int, rounds: int, only: str) -> dict:
    """kernels() in a fresh process with OMP_NUM_THREADS=threads."""
    code = f"import json, bench_avx512 as b; print('RESULT', json.dumps(b.kernels({m}, {rounds}, {only!r})))"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.split("RESULT", 1)[1])


def decode(flash_dir: str, tokens: int, rounds: int) -> dict:
    """Resident decode steps (resident_decode.flash_tokens_per_s, a fresh process each), MLX_FLASH_AVX512 0 and 1
    alternating: {"avx2": [runs], "avx512": [runs]}."""
    code = (
        "import json, resident_decode as r; from mlx_flash.compute import cpu_gemv; "
        f"res = r.flash_tokens_per_s({flash_dir!r}, {tokens}); res['info'] = cpu_gemv.info(); "
        "print('RESULT', json.dumps(res))"
    )
    runs = {"avx2": [], "avx512": []}
    for _ in range(rounds):
        for key, on in (("avx2", "0"), ("avx512", "1")):
            env = {**os.environ, "MLX_FLASH_AVX512": on, "PYTHONPATH": str(Path(__file__).parent)}
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.split("RESULT", 1)[1])
            assert bool(res["info"]["avx512"]) == (on == "1")
            runs[key].append({k: res[k] for k in ("tokens_per_s", "step_ms_median", "native_step", "tokens")})
            print(f"  decode, {key}: {res['tokens_per_s']:.2f} tokens/s, median step {res['step_ms_median']:.1f} ms")
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--positions", type=int, default=1, help="m positions a product (1: a decode step)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--only", default="", help="the products whose name contains this (e.g. block_axpy)")
    p.add_argument("--decode", default=None, help="a flash directory: whole resident decode steps too")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--decode-rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    info = cpu_gemv.info()
    if not info.get("avx512_cpu"):
        sys.exit(f"the CPU lacks AVX-512 F/BW/VL/VNNI (cpu_gemv.info(): {info})")
    result = {"machine": platform.platform(), "processor": platform.processor(), "cpu_gemv": info, "kernels": {}}
    print("| product | threads | AVX2 / VNNI ms | AVX-512 ms | speed-up | AVX-512 GB/s |\n|---|---|---|---|---|---|")
    for t in (int(v) for v in args.threads.split(",")):
        result["kernels"][t] = run_kernels(t, args.positions, args.rounds, args.only)
        for name, r in result["kernels"][t].items():
            print(
                f"| {name} | {t} | {r['avx2_ms']:.3f} | {r['avx512_ms']:.3f} | {r['speedup']:.2f}x | "
                f"{r['avx512_gb_per_s']:.0f} |",
                flush=True,
            )
    if args.decode:
        runs = decode(args.decode, args.tokens, args.decode_rounds)
        med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
        same = all(r["tokens"] == runs["avx2"][0]["tokens"] for v in runs.values() for r in v)
        result["decode"] = {"flash_dir": args.decode, "runs": runs, "median_tokens_per_s": med, "same_tokens": same}
        print(
            f"decode: AVX2 / VNNI {med['avx2']:.2f}, AVX-512 {med['avx512']:.2f} tokens/s "
            f"({med['avx512'] / med['avx2']:.2f}x); the same tokens: {same}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
