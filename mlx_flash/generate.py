"""Generate text with FFN weights streamed from flash.

    python -m mlx_flash.generate --prompt "Once upon a time" --memory-budget 50% --stats

Flags mirror mlx_lm.generate; with no --model the default model (SmolLM2-135M-Instruct)
is converted once into ~/.cache/mlx_flash and used.
"""

import argparse
import sys

import mlx_flash  # noqa: F401  (before mlx.core: loads OpenBLAS on Linux)

from . import blas, cpu_gemv
from .budget import fmt_bytes
from .default_model import default_model_dir
from .errors import FlashError
from .flash_format import FlashDir
from .generation import print_response_stats, stream_generate
from .loader import MAX_PPL_INCREASE, load, load_tokenizer
from .sparsity import SPARSITIES
from .stats import Stats

DEFAULT_PROMPT = "Once upon a time"


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Generate text from a flash directory, streaming FFN neurons from flash.")
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct, converted once).")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="Message to the model ('-' reads stdin).")
    p.add_argument("--system-prompt", default=None, help="System prompt for the chat template.")
    p.add_argument("--ignore-chat-template", action="store_true", help="Use the raw prompt without the chat template.")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="Maximum number of tokens to generate.")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature.")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p.")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed.")
    p.add_argument("--memory-budget", default=None, help="Memory for weights, caches and KV cache: bytes, 2GB, 512MiB or 50%% of the model (default: all).")
    p.add_argument("--sparsity", default="auto", choices=["auto", *SPARSITIES],
                   help="How each token's active neurons are chosen (auto: the directory's calibrated selector, "
                        "if within --max-ppl-increase; else dense).")
    p.add_argument("--max-ppl-increase", type=float, default=MAX_PPL_INCREASE,
                   help="auto: the largest perplexity increase (measured at calibration) accepted from a selector.")
    p.add_argument("--density", type=float, default=None, help="oracle, sketch, predictor: keep this fraction of neurons (top-K); dip, wina: input and neuron density.")
    p.add_argument("--gamma", type=float, default=1.0, help="DIP-CA cache-aware weight for uncached units (1 = off, paper: 0.2).")
    p.add_argument("--window", type=int, default=5, help="Keep neurons active in the last K tokens cached.")
    p.add_argument("--cache-policy", default=None, choices=["window", "lru", "lfu"],
                   help="Unit cache eviction policy (default: window for neurons, lru for experts: a token's experts "
                        "are few, and the window would drop every expert not used in the last --window tokens).")
    p.add_argument("--kv-bits", type=int, default=None, choices=[4, 8], help="Quantise the KV cache from the first token (default: float).")
    p.add_argument("--kv-group-size", type=int, default=64, help="Group size of the quantised KV cache.")
    p.add_argument("--threads", type=int, default=None, help="Reader threads (default: measured best).")
    ahead = p.add_mutually_exclusive_group()
    ahead.add_argument("--no-prefetch", action="store_true", help="Dense: read each layer's uncached units when it runs, not while the previous one computes.")
    ahead.add_argument("--prefetch", action="store_true", help="MoE: read the experts the next layer's router predicts while a layer computes (off by default: it did not pay on the bench).")
    p.add_argument("--cached-io", action="store_true", help="Read through the OS page cache instead of O_DIRECT / F_NOCACHE.")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="Speculative decoding with drafts from n-gram matches in the prompt and the text so far "
                        "(lossless; pays on tasks that reuse their input: summarising, extracting, editing).")
    p.add_argument("--draft-model", default=None,
                   help="Speculative decoding with drafts from this flash directory (same tokenizer), resident "
                        "inside --memory-budget.")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="The deepest draft a pass verifies (default 8; shallower after rejections).")
    p.add_argument("--exact", action="store_true",
                   help="float32 activations in the CPU kernels, mlx-lm's float arithmetic (also MLX_FLASH_INT8=0); "
                        "the default rounds them to int8 per block of 32. Either way the output is the same at every budget.")
    p.add_argument("--stats", action="store_true", help="Print the per-token I/O / memory / compute breakdown and a summary.")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True, help="Stream text as it is generated.")
    return p


def print_stats(engine, out=sys.stdout):
    import mlx.core as mx


    stats: Stats = engine.stats
    print("\n" + "=" * 10 + " per-token stats (decode) " + "=" * 10, file=out)
    for i, t in enumerate(stats.decode_tokens()):
        print(Stats.format_token(i, t), file=out)
    s = stats.summary()
    if s["tokens"]:
        print(
            f"summary over {s['tokens']} tokens (medians): io {s['io_ms']:.2f} ms, mm {s['mm_ms']:.2f} ms, "
            + (f"expand {s['expand_ms']:.2f} ms, " if s["expand_ms"] else "")
            + f"compute {s['compute_ms']:.2f} ms, total {s['total_ms']:.2f} ms ({1e3 / s['total_ms']:.2f} tok/s); "
            f"read {fmt_bytes(s['bytes_per_token'])}/token at the device ({fmt_bytes(s['bytes_requested_per_token'])} asked)"
            + (f" (of which resident weights streamed {fmt_bytes(s['streamed_bytes_per_token'])})"
               if s["streamed_bytes_per_token"] else "")
            + (f" at {fmt_bytes(s['read_bytes_per_s'])}/s while reads were in flight" if s["read_bytes_per_s"] else "")
            + f", hit rate {s['hit_rate']:.1%}, "
            f"active units/layer {s['active_per_layer']:.1f}"
            + (f"; read ahead {fmt_bytes(s['ahead_bytes_per_token'])}/token "
               f"({fmt_bytes(s['ahead_wasted_bytes_per_token'])} not used), the next layer's router predicted "
               f"{s['prediction_accuracy']:.1%} of the experts routed" if s["prediction_accuracy"] is not None else ""),
            file=out,
        )
    spec = getattr(engine, "speculative", None)
    if spec is not None and spec.passes:
        s, passes = spec.summary(), stats.decode_tokens()
        print(f"speculative: {s['passes']} passes, {s['drafted']} drafted, {s['accepted']} accepted "
              f"({s['acceptance']:.1%}), {s['mean_accepted_length']:.2f} tokens a pass; per generated token "
              f"{fmt_bytes(sum(t.bytes_read for t in passes) / s['generated'])} read at the device, "
              f"{1e3 * sum(t.total_s for t in passes) / s['generated']:.2f} ms", file=out)
    peak = stats.peak_rss()
    if peak is not None:
        print(f"memory: peak RSS {fmt_bytes(peak)} above the baseline of {fmt_bytes(stats.baseline_rss)} "
              f"(interpreter, mlx, mlx-lm, tokenizer); MLX peak {fmt_bytes(mx.get_peak_memory())}", file=out)
    if mx.default_device() == mx.cpu:
        print(f"CPU: quantised decode matvecs {'native (kernels/cpu_gemv.c)' if cpu_gemv.available() else 'MLX ops'}, "
              f"BLAS {blas.status}", file=out)
    sp = engine.sparsifier
    detail = f" {sp.bits}-bit gate/up" if getattr(sp, "bits", None) else ""
    print(f"selector: {sp.name}{detail}, resident {fmt_bytes(getattr(sp, 'nbytes', 0))} (the plan's extra)", file=out)
    if engine.why:
        print(engine.why, file=out)
    print(engine.plan.describe({k: v.stride for k, v in engine.fd.layouts.items()},
                               {k: r.n_units for k, r in engine.fd.layers[0].items()}), file=out)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.exact:
        cpu_gemv.set_int8_activations(False)
    try:
        path = args.model or default_model_dir()
        tokenizer = load_tokenizer(FlashDir(path))
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if not args.ignore_chat_template and tokenizer.chat_template is not None:
            messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + [
                {"role": "user", "content": prompt}
            ]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            prompt = tokenizer.encode(prompt)
        model, tokenizer = load(
            path, memory_budget=args.memory_budget, sparsity=args.sparsity, window=args.window,
            policy=args.cache_policy, density=args.density, gamma=args.gamma, threads=args.threads,
            direct=not args.cached_io, context=len(prompt) + args.max_tokens,  # the KV cache it will need
            prefetch=False if args.no_prefetch else (True if args.prefetch else None),
            kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
            max_ppl_increase=args.max_ppl_increase, draft_model=args.draft_model,
        )
    except (FlashError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sampler = make_sampler(args.temp, args.top_p)
    response = None
    try:
        step = model.flash.plan.prefill_step(model.flash.fd.config, len(prompt) + args.max_tokens)  # within the budget
        for response in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler,
                                        prefill_step_size=step, draft_model=model.draft_model,
                                        prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens):
            if args.verbose:
                print(response.text, end="", flush=True)
        if args.verbose and response is not None:
            print_response_stats(response)
        if args.stats:
            print_stats(model.flash)
    finally:
        model.flash.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
