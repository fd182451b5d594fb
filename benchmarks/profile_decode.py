"""Where a decode step's time goes: tokens/s of mlx_flash.generate.generate_step after the first token,
then (--prof) a cProfile of the same run, sorted by own time.

    python benchmarks/profile_decode.py [--model FLASH_DIR] [--memory-budget B] [--tokens 64] [--prof]
"""

import argparse
import cProfile
import pstats
import time

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.generate import generate_step
from mlx_flash.loader import load

import mlx.core as mx


def tokens_per_s(model, prompt, n: int) -> float:
    t1 = None
    for k, _ in enumerate(generate_step(prompt, model, max_tokens=n + 1)):
        if k == 0:
            t1 = time.perf_counter()
    return n / (time.perf_counter() - t1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="flash directory (default: SmolLM2)")
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prof", action="store_true")
    args = p.parse_args()
    model, tok = load(args.model, memory_budget=args.memory_budget)
    prompt = mx.array(tok.encode("Once upon a time, in a land far away, there lived"))
    tokens_per_s(model, prompt, 8)  # warm up
    why = model.flash.decoder_why
    print(
        f"{tokens_per_s(model, prompt, args.tokens):.2f} tokens/s (native step: "
        f"{'yes' if model.decoder is not None else f'no, {why}'})"
    )
    if args.prof:
        pr = cProfile.Profile()
        pr.enable()
        tokens_per_s(model, prompt, args.tokens)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
