"""Error added by storing down_proj per neuron (issue 2): re-quantised along d_model vs float.

    python benchmarks/down_quant_error.py [--tokens 512]

Compares, against the source model (the GGUF loaded by mlx-lm), the resident-only
flash model converted (a) with down re-quantised to 4 bits along d_model and
(b) 8 bits and (c) float16 (--down-bits 4|8|float): max |logit diff|, perplexity on WikiText-2 and greedy tokens.
"""

import argparse
import math
import tempfile
from pathlib import Path

import mlx_flash  # noqa: F401
from mlx_flash.convert import convert
from mlx_flash.convert.gguf import gguf_to_mlx_dir
from mlx_flash.convert.source import load_source_model
from mlx_flash.default_model import default_gguf_path
from mlx_flash.loader import load_resident
from mlx_flash.texts import wikitext

import mlx.core as mx
import mlx.nn as nn


def perplexity(model, tokens):
    logits = model(tokens[None, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits[0], tokens[1:]).mean().item()), logits


def greedy(model, tokens, n):
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(tokens, model, max_tokens=n):
        out.append(int(tok))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--text", default=str(wikitext()))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as work:
        work = Path(work)
        src_dir = gguf_to_mlx_dir(default_gguf_path(), work / "src")
        src, _ = load_source_model(src_dir, lazy=False)
        tok = load_tokenizer_from(src_dir)
        text = open(args.text).read()[:20000]
        tokens = mx.array(tok.encode(text)[: args.tokens + 1])
        prompt = mx.array(tok.encode("The history of the city begins"))
        ppl_src, logits_src = perplexity(src, tokens)
        ref = greedy(src, prompt, 32)
        print(f"source: ppl {ppl_src:.3f} on {args.tokens} WikiText-2 tokens")
        for bits in ("4", "8", "float"):
            name = f"--down-bits {bits}"
            out = convert(str(default_gguf_path()), work / f"down{bits}", progress=False, down_bits=bits)
            model, fd = load_resident(out)
            ppl, logits = perplexity(model, tokens)
            same = greedy(model, prompt, 32) == ref
            print(
                f"{name}: bundle {fd.layouts['neurons'].nbytes} B, "
                f"max |dlogit| {mx.abs(logits - logits_src).max().item():.4f}, "
                f"ppl {ppl:.3f} ({(ppl / ppl_src - 1) * 100:+.2f}%), greedy 32 tokens identical: {same}"
            )


def load_tokenizer_from(path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path)


if __name__ == "__main__":
    main()
