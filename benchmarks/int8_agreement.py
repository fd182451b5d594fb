"""Greedy agreement of int8 against float32 activations in the native matvecs (everything else the same).

    python benchmarks/int8_agreement.py [--model FLASH_DIR] [--tokens 64]

For each prompt: how many of the first N greedy tokens are identical (BENCHMARKS.md, "Decoding at the
memory's speed on the CPU").
"""

import argparse
import statistics

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.compute import cpu_gemv
from mlx_flash.generate import generate_step
from mlx_flash.loader import load

import mlx.core as mx

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Write a Python function that reverses a list.",
    "Explain why the sky is blue.",
    "List three uses of copper:",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    model, tok = load(args.model)
    same = []
    for prompt in PROMPTS:
        ids, outs = mx.array(tok.encode(prompt)), []
        for int8 in (False, True):
            cpu_gemv.set_int8_activations(int8)
            outs.append([t for t, _ in generate_step(ids, model, max_tokens=args.tokens)])
        same.append(next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), args.tokens))
        print(f"{same[-1]:3d} of {args.tokens} identical  {prompt[:48]!r}")
    print(f"median {statistics.median(same)}")


if __name__ == "__main__":
    main()
