"""Greedy tokens of `--sparsity dense` under a budget against the same directory with every weight resident.

    python benchmarks/lossless_check.py --model DIR --memory-budget 50% --max-tokens 16 [--json out.json]

The lossless claim of the peer table, checked on the same weights: load_resident (every FFN unit in
memory, ResidentFFN) and load(..., memory_budget, sparsity="dense") (units streamed and read ahead)
must generate the same tokens from the same prompt, and their log-probabilities should agree to float
rounding (random weights make greedy tokens a weak check: a synthetic model may repeat one token).
"""

import argparse
import json
import sys

import mlx_flash  # noqa: F401  (before mlx.core: loads OpenBLAS on Linux)
from mlx_flash.budget import parse_size
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step  # the loop users run
from mlx_flash.loader import load, load_resident, load_tokenizer
from mlx_flash.tools.bench_io import machine_info

import mlx.core as mx


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Dense streaming under a budget vs the resident model: same tokens?")
    p.add_argument("--model", required=True, help="Flash directory.")
    p.add_argument("--memory-budget", default="50%", help="Budget of the streamed model (bytes, 2GB or 50%%).")
    p.add_argument("--prompt", default="The history of the city", help="Prompt (raw, no chat template).")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", default=None, help="Write the result here.")
    return p


def greedy(model, prompt, n):
    """(tokens, log-probabilities [n, vocab])."""
    steps = list(generate_step(mx.array(prompt), model, max_tokens=n))
    return [int(t) for t, _ in steps], mx.stack([lp for _, lp in steps])


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    fd = FlashDir(args.model)
    prompt = load_tokenizer(fd).encode(args.prompt)
    budget = parse_size(args.memory_budget, fd.model_bytes)
    model, _ = load(args.model, memory_budget=budget, sparsity="dense", context=len(prompt) + args.max_tokens + 1)
    try:
        streamed, lp_streamed = greedy(model, prompt, args.max_tokens)
    finally:
        model.flash.close()
    del model
    ref, _ = load_resident(args.model, dtype=mx.float32)
    resident, lp_resident = greedy(ref, prompt, args.max_tokens)
    same = streamed == resident
    diff = mx.abs(lp_streamed - lp_resident).max().item()
    res = {
        "model": args.model,
        "budget": budget,
        "prompt": args.prompt,
        "streamed": streamed,
        "resident": resident,
        "identical": same,
        "max_abs_logprob_diff": diff,
        "machine": machine_info(args.model),
    }
    print(
        f"{args.model}: budget {args.memory_budget}, {args.max_tokens} tokens: "
        + ("identical" if same else f"DIFFER\n  streamed {streamed}\n  resident {resident}")
        + f"; log-probabilities differ by at most {diff:.3g}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
