"""What the CPU default (int8 activations, float16 keys and values) costs against float32 on held-out text, measured
on the path it runs on (decode steps).

    python benchmarks/int8_quality.py [--model DIR] [--windows 4] [--tokens 128] [--greedy 64]
        [--out benchmarks/results/int8_quality_smollm2.json]

Prompt passes compute in float (MLX / BLAS), so a perplexity over whole windows never meets the int8 kernels.
Here every window (BOS + TOKENS tokens of the held-out, second half of the bundled WikiText-2 test split) is fed
one token per forward pass with a KV cache, as decoding does, and each next token is scored: perplexity with
int8 activations with float16 keys and values (the CPU default), int8 activations with float32 keys and values, and
float32 throughout (`--exact`, MLX_FLASH_INT8=0); for each against float32, the share of positions whose argmax
agrees and greedy agreement: the tokens both modes generate from the same prompts until they first differ. Each
mode loads the model afresh, since `load` chooses the KV cache's dtype (loader.half_kv).
"""

import argparse
import json
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (first: it preloads OpenBLAS before MLX loads a BLAS)
from mlx_flash import loader
from mlx_flash.compute import cpu_gemv
from mlx_flash.generate import generate_step
from mlx_flash.loader import load
from mlx_flash.texts import read_text, token_batches

import mlx.core as mx
import numpy as np

PROMPTS = (
    "Once upon a time there was a",
    "The capital of France is",
    "def fibonacci(n):",
    "The history of the city begins",
    "Water boils at",
    "My favourite book is",
)


def score(model, windows):
    """(negative log-likelihoods, argmaxes) of each next token, one token per forward pass."""
    nll, top = [], []
    for w in windows:
        cache = model.make_cache()
        for i in range(len(w) - 1):
            logits = model(mx.array(w[None, i : i + 1]), cache=cache)[0, -1].astype(mx.float32)
            lp = logits - mx.logsumexp(logits)
            nll.append(-lp[int(w[i + 1])].item())
            top.append(int(mx.argmax(lp).item()))
    return np.array(nll), np.array(top)


def load_with(path, context, half):
    """`load`, its KV cache in float16 as `load` chooses (half None) or not (False)."""
    if half is None:
        return load(path, context=context)
    chosen = loader.half_kv
    loader.half_kv = lambda *a, **k: False
    try:
        return load(path, context=context)
    finally:
        loader.half_kv = chosen


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Flash directory (default: the default model).")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--greedy", type=int, default=64, help="Tokens generated from each prompt.")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = {
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "windows": args.windows,
        "tokens": args.tokens,
        "cpu": cpu_gemv.info(),
    }
    res = {}
    for mode, int8, half in (("int8", True, None), ("int8_float32_kv", True, False), ("float32", False, None)):
        cpu_gemv.set_int8_activations(int8)
        model, tok = load_with(args.model, max(args.tokens, args.greedy) + 64, half)
        windows = token_batches(tok, read_text(half="second"), args.tokens, args.windows)
        t = time.perf_counter()
        nll, top = score(model, windows)
        gen = [
            [int(t) for t, _ in generate_step(mx.array(tok.encode(q)), model, max_tokens=args.greedy)] for q in PROMPTS
        ]
        res[mode] = (nll, top, gen)
        kv = {c.dtype.name for c in model.make_cache() if hasattr(c, "dtype")}
        out[mode] = {"perplexity": float(np.exp(nll.mean())), "kv": sorted(kv), "seconds": time.perf_counter() - t}
        print(mode, out[mode], flush=True)
        model.flash.close()
    cpu_gemv.set_int8_activations(True)
    b = res["float32"]
    for mode in ("int8", "int8_float32_kv"):
        a = res[mode]
        out[mode]["perplexity_increase"] = out[mode]["perplexity"] / out["float32"]["perplexity"] - 1
        out[mode]["argmax_agreement"] = float((a[1] == b[1]).mean())
        out[mode]["greedy_agreeing_prefix"] = [
            next((i for i, (x, y) in enumerate(zip(g, h)) if x != y), len(g)) for g, h in zip(a[2], b[2])
        ]
    print(json.dumps({k: v for k, v in out.items() if k != "cpu"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
