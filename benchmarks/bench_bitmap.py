"""ENDOR bitmap rows: compression ratio and the cost of expanding them per token.

1. Compression: rows pruned with Wanda/magnitude to 50% (and other sparsities), per-row
   capacity = the exact kept count, for float16 rows and 8-bit (uint8) rows; ratio =
   encoded bytes / dense bytes (ENDOR reports 56% for float16 and 62% for int8 at 50%).
2. Expand cost: per layer, the k active units of each of the three FFN matrices (gate, up,
   down: each a row of length d per neuron) are expanded from encoded float16 rows into
   dense rows with bitmap.expand (MLX ops here; the Metal kernel on Apple silicon), for
   SmolLM2-135M-like (d=576, n=1536, 30 layers) and 7B-like (d=4096, n=11008, 32 layers)
   shapes and k = 25/50/100% of n. Beside it: a plain row gather (mx.take) of the dense rows
   of the same units, the copy the runtime does anyway, and the bytes each would read.

    python benchmarks/bench_bitmap.py [--reps 5] [--sparsity 0.5] [--shapes smollm2,7b]
"""

import argparse

import mlx_flash  # noqa: F401  (before mlx.core)
from mlx_flash.convert import prune
from mlx_flash.format import bitmap

import mlx.core as mx
import numpy as np
from bench_gather_ffn import median_ms  # noqa: E402  (this script's directory is on sys.path)

SHAPES = {"smollm2": (576, 1536, 30), "7b": (4096, 11008, 32)}


def compression_table(sparsity: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for d in (576, 4096):
        w = rng.standard_normal((256, d)).astype(np.float32)
        norms = rng.random(d).astype(np.float32) + 0.5
        pruned = prune.prune_wanda(w, norms, sparsity)
        mask = pruned != 0
        for name, vals in (
            ("float16", pruned.astype(np.float16)),
            ("uint8", rng.integers(0, 256, (256, d)).astype(np.uint8)),
        ):
            enc, cap = bitmap.encode_rows(vals, mask=mask)
            assert enc.shape[1] == bitmap.row_bytes(d, cap, name)
            dense = d * bitmap.DTYPES[name][0]
            rows.append((name, d, sparsity, cap, dense, enc.shape[1], enc.shape[1] / dense))
    return rows


def down_capacity_table(sparsity: float, seed: int = 0):
    """down_proj [d, n]: a unit stores column i. Wanda per output row leaves each column a
    varying count, so the fixed capacity (the max) grows; per="input" keeps it exact."""
    rng = np.random.default_rng(seed)
    rows = []
    for d, n in ((576, 1536), (4096, 11008)):
        w = rng.standard_normal((d, n)).astype(np.float32)
        for spread in (0.0, 1.0):  # log-normal spread of the neuron norms ||h_i||
            norms = np.exp(spread * rng.standard_normal(n)).astype(np.float32)
            for per in ("output", "input"):
                units = prune.prune_wanda(w, norms, sparsity, per=per).T  # [n, d]: one row per unit
                cap = int((units != 0).sum(1).max())
                rows.append((d, n, spread, per, cap, bitmap.compression_ratio(d, cap, "float16")))
    return rows


def _time(fn, reps):
    """Median seconds of mx.eval(fn()) after a warm-up."""
    return median_ms(fn, reps) / 1e3


def expand_table(shapes, sparsity: float, reps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for shape in shapes:
        d, n, layers = SHAPES[shape]
        r_reps = reps if d * n < 2**24 else max(1, reps // 2)
        w = rng.standard_normal((n, d)).astype(np.float32)
        w16 = prune.prune_magnitude(w, sparsity).astype(np.float16)
        enc, cap = bitmap.encode_rows(w16)
        enc_mx, dense_mx = mx.array(enc), mx.array(w16)
        del w, w16
        for frac in (0.25, 0.5, 1.0):
            k = int(frac * n)
            idx = mx.array(np.sort(rng.choice(n, k, replace=False)).astype(np.int32))
            # three matrices per unit (gate, up, down): expand each from its gathered rows
            t_exp = _time(
                lambda: [bitmap.expand(mx.take(enc_mx, idx, axis=0), d, mx.float16) for _ in range(3)], r_reps
            )
            t_take = _time(lambda: [mx.take(dense_mx, idx, axis=0) for _ in range(3)], r_reps)
            t_gexp = _time(lambda: [mx.take(enc_mx, idx, axis=0) for _ in range(3)], r_reps)
            out.append(
                dict(
                    shape=shape,
                    d=d,
                    n=n,
                    k=k,
                    frac=frac,
                    layers=layers,
                    expand_ms=1e3 * (t_exp - t_gexp),
                    gather_enc_ms=1e3 * t_gexp,
                    gather_dense_ms=1e3 * t_take,
                    mb_enc=3 * k * enc.shape[1] / 2**20,
                    mb_dense=3 * k * d * 2 / 2**20,
                )
            )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--shapes", default="smollm2,7b")
    args = p.parse_args()

    print(f"mlx {mx.__version__}, device {mx.default_device()}, metal {bitmap.metal_available()}")
    print("\n== compression (encoded / dense bytes per row) ==")
    print(f"{'dtype':8} {'d':>5} {'sparsity':>8} {'capacity':>8} {'dense B':>8} {'encoded B':>9} {'ratio':>6}")
    for s in sorted({0.5, args.sparsity, 0.6, 0.7}):
        for name, d, sp, cap, dense, encb, r in compression_table(s):
            print(f"{name:8} {d:5d} {sp:8.2f} {cap:8d} {dense:8d} {encb:9d} {r:6.3f}")

    print(f"\n== down_proj units at {args.sparsity:.0%}: capacity per Wanda grouping (float16) ==")
    print(f"{'d':>5} {'n':>6} {'norm spread':>11} {'per':>6} {'capacity':>8} {'ratio':>6}")
    for d, n, spread, per, cap, r in down_capacity_table(args.sparsity):
        print(f"{d:5d} {n:6d} {spread:11.1f} {per:>6} {cap:8d} {r:6.3f}")

    print(
        f"\n== expand cost per layer (3 matrices x k rows, float16, {args.sparsity:.0%} sparse, "
        f"{'Metal' if bitmap.metal_available() else 'MLX ops, CPU'}) =="
    )
    print(
        f"{'shape':8} {'k':>6} {'%n':>4} {'expand ms':>9} {'gather enc ms':>13} {'gather dense ms':>15} "
        f"{'MB enc':>7} {'MB dense':>8} {'ns/elem':>7} {'expand ms/token':>15}"
    )
    for r in expand_table(args.shapes.split(","), args.sparsity, args.reps):
        print(
            f"{r['shape']:8} {r['k']:6d} {r['frac']:4.0%} {r['expand_ms']:9.2f} {r['gather_enc_ms']:13.2f} "
            f"{r['gather_dense_ms']:15.2f} {r['mb_enc']:7.2f} {r['mb_dense']:8.2f} "
            f"{1e6 * r['expand_ms'] / (3 * r['k'] * r['d']):7.2f} "
            f"{r['expand_ms'] * r['layers']:15.1f}"
        )
    print(
        "expand ms = time(gather encoded rows + expand) - time(gather encoded rows); "
        "ms/token = expand ms x layers (every layer's active units expanded once; "
        "a neuron cache holding expanded rows would pay this only on misses)"
    )


if __name__ == "__main__":
    main()
