"""Where a decode step's time goes: tokens/s of mlx_flash.generate.generate_step after the first token,
then (--kernels) the same run's time in each native kernel per token (the rest: Python, MLX and waits), and
(--prof) a cProfile of it, sorted by own time.

    python benchmarks/profile_decode.py [--model FLASH_DIR] [--memory-budget B] [--tokens 64] [--kernels] [--prof]
"""

import argparse
import collections
import cProfile
import pstats
import time

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash import _cpu_gemv
from mlx_flash.generate import generate_step
from mlx_flash.loader import load

import mlx.core as mx


def tokens_per_s(model, prompt, n: int) -> float:
    t1 = None
    for k, _ in enumerate(generate_step(prompt, model, max_tokens=n + 1)):
        if k == 0:
            t1 = time.perf_counter()
    return n / (time.perf_counter() - t1)


KERNELS = (
    "attention_batch",
    "ffn_glu",
    "expert_glu",
    "block_dot",
    "row_dot_pairs",
    "glu_pairs",
    "row_dot",
    "silu_mul",
    "block_axpy",
    "row_axpy",
)


def kernel_times(model, prompt, n: int) -> dict:
    """ms per decode step in each native kernel over n steps, and the rest ("other")."""
    spent = collections.Counter()

    def timed(name, f):
        def call(*args):
            t = time.perf_counter()
            try:
                return f(*args)
            finally:
                spent[name] += time.perf_counter() - t

        return call

    saved = {k: getattr(_cpu_gemv, k) for k in KERNELS}
    for k, f in saved.items():
        setattr(_cpu_gemv, k, timed(k, f))
    try:
        t0 = None
        for k, _ in enumerate(generate_step(prompt, model, max_tokens=n + 1)):
            if k == 0:
                spent.clear()
                t0 = time.perf_counter()
        total = time.perf_counter() - t0
    finally:
        for k, f in saved.items():
            setattr(_cpu_gemv, k, f)
    out = {k: 1e3 * v / n for k, v in spent.items()}
    return {"total": 1e3 * total / n, **out, "other": 1e3 * (total - sum(spent.values())) / n}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="flash directory (default: SmolLM2)")
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--kernels", action="store_true", help="Time each native kernel per token.")
    p.add_argument("--prof", action="store_true")
    args = p.parse_args()
    model, tok = load(args.model, memory_budget=args.memory_budget)
    prompt = mx.array(tok.encode("Once upon a time, in a land far away, there lived"))
    tokens_per_s(model, prompt, 8)  # warm up
    why = model.forward.why
    print(
        f"{tokens_per_s(model, prompt, args.tokens):.2f} tokens/s (native step: "
        f"{'yes' if model.forward.native else f'no, {why}'})"
    )
    if args.kernels:
        print("ms per token:", ", ".join(f"{k} {v:.1f}" for k, v in kernel_times(model, prompt, args.tokens).items()))
    if args.prof:
        pr = cProfile.Profile()
        pr.enable()
        tokens_per_s(model, prompt, args.tokens)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
