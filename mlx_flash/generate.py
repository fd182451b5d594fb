"""Generate text with FFN weights streamed from flash: the loop and the command.

    python -m mlx_flash.generate --prompt "Once upon a time" --memory-budget 50% --stats

The loop is mlx-lm's `generate_step`, `stream_generate` and `generate` (same arguments, yields and responses)
with two forward passes fewer before the first token (`generate_step`); `mlx_flash.generate` and
`mlx_flash.stream_generate` are these functions, as in mlx-lm. The command's flags mirror mlx_lm.generate; with no
--model the default model (SmolLM2-135M-Instruct) is converted once into ~/.cache/mlx_flash and used.
"""

import argparse
import sys
import time
from contextlib import nullcontext
from functools import partial

from . import blas, pipeline
from .budget import fmt_bytes, parse_size
from .compute import cpu_gemv
from .default_model import model_dir
from .engine.forward import BACKENDS, head_on
from .engine.native_step import HostKVCache
from .engine.prompt_store import PromptStore, identity
from .engine.sparsity import SPARSITIES
from .engine.stats import Stats
from .errors import BudgetError, FlashError
from .format.directory import FlashDir
from .io import memory
from .loader import MAX_PPL_INCREASE, load, load_tokenizer
from .speculative import AdaptiveDepth, SpeculativeStats, accept, make_drafter

DEFAULT_DRAFT_TOKENS = 8  # the deepest draft; speculative.AdaptiveDepth goes shallower after rejections


class _Passes:
    """Forward passes of `model` into `cache`, as mlx-lm's loop runs them: a flash model's pass (`model.forward`,
    engine/forward.py), a stock model's own call; logits processors see the tokens fed so far."""

    def __init__(self, model, cache, sampler, logits_processors, stream, kv):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.processors, self.stream, self.kv = logits_processors or (), stream, kv
        self.history = None  # the tokens fed so far, for the logits processors
        self.store, self.grid, self.prompt_tokens = None, 1, 0  # (a PromptStore: `fetch`, `keep`)

    def fetch(self, store, prompt: list, grid: int, make_cache) -> int:
        """The longest prefix of `prompt` `store` holds, read as the cache: its length."""
        self.store, self.grid, self.prompt_tokens = store, grid, len(prompt)
        cache, n = store.fetch(prompt, make_cache, grid)
        if cache is not None:
            self.cache = cache
        return n

    def keep(self, tokens: list) -> None:
        """Store the cache (holding `tokens`): every position where rows compute alone, else those of whole prompt
        chunks (prompt_store module)."""
        valid = len(tokens) if self.grid == 1 else self.prompt_tokens // self.grid * self.grid
        self.store.save(tokens, self.cache, self.grid, valid)

    def __call__(self, tokens, logits: str):
        """Run `tokens` (mx.array [m]) through the model into the cache. logits "none": nothing back; "last":
        (token, logprobs [vocab]) of the last position; "all": (tokens [m], logprobs [m, vocab])."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache

        if self.processors:
            self.history = tokens if self.history is None else mx.concat([self.history, tokens])
        prompt = logits != "all"
        with mx.stream(self.stream or generation_stream):
            forward = getattr(self.model, "forward", None)
            if forward is not None:  # (a prompt's pass: its last position's logits only)
                out = forward(tokens.tolist(), self.cache, prompt=prompt and len(tokens) > 1)
            else:
                with head_on(self.model, [-1] if len(tokens) > 1 and logits == "last" else None):
                    out = self.model(tokens[None], cache=self.cache)
            maybe_quantize_kv_cache(self.cache, *self.kv)
            if logits == "none":  # the head's output is never evaluated
                # (a HostKVCache is written as the pass runs: its state would be a copy of the cache for nothing)
                mx.eval([c.state for c in self.cache if not isinstance(c, HostKVCache)])
                return None
            if logits == "last":
                y, logprobs = self._sample(out[:, -1, :], 0)
                mx.eval(y, logprobs)
                return y, logprobs.squeeze(0)
            ys, lps = zip(*(self._sample(out[:, i, :], len(tokens) - 1 - i) for i in range(len(tokens))))
            ys, lps = mx.concatenate(ys), mx.concatenate(lps)
            mx.eval(ys, lps)
            return ys, lps

    def _sample(self, out, later: int):
        """The token and logprobs from one position's logits; `later`: tokens fed after that position."""
        import mlx.core as mx

        for processor in self.processors:
            out = processor(self.history[: len(self.history) - later], out)
        logprobs = out - mx.logsumexp(out, axis=-1, keepdims=True)
        return self.sampler(logprobs), logprobs

    def trim(self, n: int) -> None:
        """Forget the last n tokens fed (rejected drafts)."""
        from mlx_lm.models.cache import trim_prompt_cache

        if n > 0:
            trim_prompt_cache(self.cache, n)
            if self.history is not None:
                self.history = self.history[: len(self.history) - n]


def _start(
    prompt,
    model,
    *,
    sampler=None,
    logits_processors=None,
    prompt_cache=None,
    prefill_step_size=2048,
    kv_bits=None,
    kv_group_size=64,
    quantized_kv_start=0,
    prompt_progress_callback=None,
    max_kv_size=None,
    input_embeddings=None,
    stream=None,
    prompt_store=None,
):
    """The prompt's passes: (passes, whether the cache is the loop's own, first token, its logprobs). `prompt_store`
    (engine.prompt_store.PromptStore): the prompt's longest stored prefix is read instead of computed, and
    `generate_step` stores its cache at the end."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    if input_embeddings is not None:
        raise ValueError("input embeddings are not supported by mlx_flash")
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    own_cache = prompt_cache is None
    if own_cache:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    passes = _Passes(
        model,
        prompt_cache,
        sampler or greedy_sampler,
        logits_processors,
        stream,
        (quantized_kv_start, kv_group_size, kv_bits),
    )
    progress = prompt_progress_callback or (lambda *_: None)
    total, done = len(prompt), 0
    if prompt_store is not None and own_cache and can_trim_prompt_cache(prompt_cache):
        # (chunks cut where a cold run cuts them: a reused prefix ends at a whole chunk where rows' bits depend on it)
        rows_alone = getattr(getattr(model, "forward", None), "rows_alone", False)
        make = partial(make_prompt_cache, model, max_kv_size=max_kv_size)
        done = passes.fetch(prompt_store, prompt.tolist(), 1 if rows_alone else prefill_step_size, make)
    progress(done, total)
    with _prompt_room(model, min(prefill_step_size, total - done)):
        while total - done > prefill_step_size:
            passes(prompt[done : done + prefill_step_size], "none")
            done += prefill_step_size
            progress(done, total)
            memory.give_back()
        y, logprobs = passes(prompt[done:], "last")
    progress(total, total)
    return passes, own_cache, y, logprobs


def _prompt_room(model, step: int):
    """A flash model's unit caches lend what its prompt's passes of `step` positions take beyond the workspace."""
    engine = getattr(model, "flash", None)
    if engine is None or engine.context is None:
        return nullcontext()
    native = getattr(getattr(model, "forward", None), "native", False)  # (None: mlx-lm's own forward over the engine)
    return engine.lending(engine.plan.prompt_loan(engine.fd, engine.context, native, step))


def generate_step(prompt, model, *, max_tokens: int = 256, **kwargs):
    """mlx-lm's `generate_step` (same arguments and yields) with two forward passes fewer before the
    first token. A flash pass reads its FFN units on the host, layer by layer, so mlx-lm's two overlaps
    only cost passes: its prompt's last token gets a pass of its own (here it ends the last prompt
    chunk, whose head runs on that position alone) and it computes each token before yielding the one
    before (here after). A `prompt_cache` passed in ends holding every yielded token, as with mlx-lm
    (its server stores it under the prompt + reply): the last one is fed when the generator closes."""
    import mlx.core as mx

    passes, own_cache, y, logprobs = _start(prompt, model, **kwargs)
    n, unfed, out = 0, None, []
    try:
        while True:
            unfed = y
            out.append(y.item())
            yield out[-1], logprobs
            n += 1
            if n == max_tokens:
                break
            unfed = None  # from here the pass below owns it (a failed pass is not retried)
            y, logprobs = passes(y, "last")
            if n % 256 == 0:
                mx.clear_cache()
    finally:
        if unfed is not None and not own_cache:
            passes(unfed, "none")
            unfed = None
        if passes.store is not None and sys.exc_info()[0] in (None, GeneratorExit):  # (not after a failed pass)
            passes.keep(prompt.tolist() + (out[:-1] if unfed is not None else out))


def speculative_generate_step(
    prompt,
    model,
    drafter,
    *,
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    adaptive_draft: bool = True,
    max_tokens: int = 256,
    spec_stats=None,
    **kwargs,
):
    """`generate_step` with drafts from `drafter` (mlx_flash.speculative) verified k+1 positions a pass; yields
    (token, logprobs, from_draft) as mlx-lm's `speculative_generate_step`. Every token is the model's own choice
    given the ones before (greedy: the same tokens as `generate_step`). The cache must be trimmable; a
    `prompt_cache` passed in ends holding every yielded token."""
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache

    passes, own_cache, y, logprobs = _start(prompt, model, **kwargs)
    if not can_trim_prompt_cache(passes.cache):
        raise ValueError("speculative decoding needs a trimmable KV cache (not --max-kv-size's rotating one)")
    if hasattr(drafter, "prefill"):
        drafter.prefill(prompt.tolist())
    depth = AdaptiveDepth(num_draft_tokens, adaptive_draft)
    stats = spec_stats if spec_stats is not None else SpeculativeStats()
    tokens = prompt.tolist()
    y, n, unfed, excess = y.item(), 0, None, 0
    try:
        unfed = y
        yield y, logprobs, False
        tokens.append(y)
        n = 1
        while n < max_tokens:
            start = time.perf_counter()  # a pass's cost: drafting and verifying
            draft = [int(d) for d in drafter.propose(tokens, min(depth.depth, max_tokens - n))]
            unfed = None  # the pass below feeds y
            ys, lps = passes(mx.array([y] + draft, dtype=mx.uint32), "all")
            seconds = time.perf_counter() - start
            ys = ys.tolist()
            k = accept(draft, ys)
            passes.trim(len(draft) - k)
            depth.update(len(draft), k, seconds)
            emitted = draft[:k] + [ys[k]]
            stats.add(len(draft), k, min(len(emitted), max_tokens - n))
            for i, t in enumerate(emitted):
                excess, unfed = (k - i - 1, None) if i < k else (0, t)  # fed but not yielded / yielded, not fed
                yield t, lps[i], i < k
                tokens.append(t)
                n += 1
                if n == max_tokens:
                    break
            y = emitted[-1]
    finally:
        if not own_cache:
            passes.trim(excess)
            if unfed is not None:
                passes(mx.array([unfed], dtype=mx.uint32), "none")


def stream_generate(
    model,
    tokenizer,
    prompt,
    max_tokens: int = 256,
    draft_model=None,
    prompt_lookup: bool = False,
    num_draft_tokens=None,
    adaptive_draft: bool = True,
    **kwargs,
):
    """mlx-lm's `stream_generate` (same arguments and `GenerationResponse`s) on `generate_step` above;
    `generation_tps` is `decode_tps` (decode steps over their time); closes the flash model's stats at the end.
    `draft_model` (a model with the same tokenizer, as mlx-lm's) or
    `prompt_lookup` (n-gram drafts from the prompt and the text so far) decode speculatively, up to
    `num_draft_tokens` drafts a pass (default DEFAULT_DRAFT_TOKENS; `adaptive_draft`: fewer after rejections);
    the flash model's `speculative` then holds the drafted and accepted counts."""
    import mlx.core as mx
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        prompt = tokenizer.encode(
            prompt, add_special_tokens=tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        )
    prompt = mx.array(prompt)
    max_tokens = _within_context(model, prompt.size, max_tokens, kwargs.get("prompt_cache"))
    detokenizer = tokenizer.detokenizer
    drafter = make_drafter(prompt_lookup, draft_model)
    if drafter is None:
        tokens = _not_drafted(generate_step(prompt, model, max_tokens=max_tokens, **kwargs))
    else:
        spec = SpeculativeStats()
        if hasattr(model, "flash"):
            model.flash.speculative = spec
        tokens = speculative_generate_step(
            prompt,
            model,
            drafter,
            max_tokens=max_tokens,
            spec_stats=spec,
            num_draft_tokens=num_draft_tokens or DEFAULT_DRAFT_TOKENS,
            adaptive_draft=adaptive_draft,
            **kwargs,
        )

    def response(finish=None):
        return GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=decode_tps(n, time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
        )

    try:
        tic = time.perf_counter()
        for n, (token, logprobs, from_draft) in enumerate(tokens):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield response()
        detokenizer.finalize()
        yield response("stop" if token in tokenizer.eos_token_ids else "length")
    finally:
        tokens.close()  # feeds the last token into a caller's prompt cache, now
        if hasattr(model, "flash"):
            model.flash.stats.end()


def _within_context(model, prompt_tokens: int, max_tokens: int, prompt_cache) -> int:
    """max_tokens (-1: no limit) cut to what the flash model's planned context leaves after the prompt (and the
    tokens a prompt cache holds already): the KV cache never outgrows the budget's plan."""
    context = getattr(getattr(model, "flash", None), "context", None)
    if context is None:
        return max_tokens
    held = next((c.offset for c in prompt_cache or () if hasattr(c, "offset")), 0)
    room = context - held - prompt_tokens
    if room < 1:
        raise BudgetError(
            f"the prompt's {held + prompt_tokens} tokens leave no room in the planned context of {context} tokens "
            "(load's context, generate's --max-tokens, the server's --max-context)"
        )
    return room if max_tokens < 0 else min(max_tokens, room)


def decode_tps(steps: int, seconds: float) -> float:
    """Tokens/s of decoding: the tokens after the first (which the prompt's pass makes) over their time,
    as llama-bench counts its generation test: one token a decode step."""
    return steps / seconds if steps and seconds > 0 else 0.0


def _not_drafted(steps):
    """generate_step's (token, logprobs) as (token, logprobs, from_draft=False); closing it closes `steps`."""
    try:
        for token, logprobs in steps:
            yield token, logprobs, False
    finally:
        steps.close()


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """mlx-lm's `generate` on `stream_generate` above; afterwards `model.flash.stats` holds the tokens."""
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print_response_stats(response)
    return text


def print_response_stats(response, out=sys.stdout):
    print(
        f"\n{'=' * 10}\nPrompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec\n"
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec\n"
        f"Peak memory: {response.peak_memory:.3f} GB",
        file=out,
    )


DEFAULT_PROMPT = "Once upon a time"


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Generate text from a flash directory, streaming FFN neurons from flash.")
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct, converted once).")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="Message to the model ('-' reads stdin).")
    p.add_argument("--system-prompt", default=None, help="System prompt for the chat template.")
    p.add_argument("--ignore-chat-template", action="store_true", help="Use the raw prompt without the chat template.")
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=100,
        help="Maximum number of tokens to generate (-1: until the end of the sequence or the longest context the "
        "budget holds).",
    )
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature.")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p.")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed.")
    p.add_argument(
        "--memory-budget",
        default="auto",
        help="Memory for weights, caches and KV cache: bytes, 2GB, 512MiB, 50%% of the model, or auto (the default: "
        "all of it where the model fits in what this machine can give now, else that less a headroom).",
    )
    p.add_argument(
        "--sparsity",
        default="auto",
        choices=["auto", *SPARSITIES],
        help="How each token's active neurons are chosen (auto: the directory's calibrated selector, "
        "if within --max-ppl-increase; else dense).",
    )
    p.add_argument(
        "--max-ppl-increase",
        type=float,
        default=MAX_PPL_INCREASE,
        help="auto: the largest perplexity increase (measured at calibration) accepted from a selector.",
    )
    p.add_argument(
        "--density",
        type=float,
        default=None,
        help="oracle, sketch, predictor: keep this fraction of neurons (top-K); dip, wina: input and neuron density.",
    )
    p.add_argument(
        "--gamma", type=float, default=1.0, help="DIP-CA cache-aware weight for uncached units (1 = off, paper: 0.2)."
    )
    p.add_argument("--window", type=int, default=5, help="Keep neurons active in the last K tokens cached.")
    p.add_argument(
        "--cache-policy",
        default=None,
        choices=["window", "lru", "lfu"],
        help="Unit cache eviction policy (default: window for neurons, lru for experts: a token's experts "
        "are few, and the window would drop every expert not used in the last --window tokens).",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        choices=[4, 8],
        help="Quantise the KV cache from the first token (default: float).",
    )
    p.add_argument("--kv-group-size", type=int, default=64, help="Group size of the quantised KV cache.")
    p.add_argument(
        "--prompt-cache-dir",
        default=None,
        help="Keep prompts' KV caches in this directory: a later prompt starting the same way (in this or another "
        "process, or the server's) reads its prefix instead of prefilling it, with the same output.",
    )
    p.add_argument(
        "--prompt-cache-dir-size",
        default="8GiB",
        help="The most --prompt-cache-dir holds (the entries used longest ago go first).",
    )
    p.add_argument("--threads", type=int, default=None, help="Reader threads (default: measured best).")
    ahead = p.add_mutually_exclusive_group()
    ahead.add_argument(
        "--no-prefetch",
        action="store_true",
        help="Read each layer's units when it runs, not while the previous one computes.",
    )
    ahead.add_argument(
        "--prefetch",
        action="store_true",
        help="Read ahead while a layer computes (the default): dense, the next layer's uncached units; MoE, the "
        "experts the next layer's router predicts.",
    )
    p.add_argument(
        "--cached-io", action="store_true", help="Read through the OS page cache instead of O_DIRECT / F_NOCACHE."
    )
    p.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="Speculative decoding with drafts from n-gram matches in the prompt and the text so far "
        "(lossless; pays on tasks that reuse their input: summarising, extracting, editing).",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="Speculative decoding with drafts from this flash directory (same tokenizer), resident "
        "inside --memory-budget.",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="The deepest draft a pass verifies (default 8; shallower after rejections).",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="float results: float32 activations in the CPU kernels (also MLX_FLASH_INT8=0; the default rounds them to "
        "int8 per block of 32) and float32 keys and values on the CPU. Either way the output is the same at every "
        "budget.",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=BACKENDS,
        help="The forward pass: auto (the default, or MLX_FLASH_BACKEND): MLX's, with the native CPU step beneath it "
        "where it applies; mlx: MLX's own ops alone (what a Mac runs); native: as auto, an error where it cannot run.",
    )
    p.add_argument(
        "--stats", action="store_true", help="Print the per-token I/O / memory / compute breakdown and a summary."
    )
    p.add_argument(
        "--pipeline-split",
        default=None,
        help="Under mlx.launch: the layers of each rank, e.g. 12,18 (rank 0 runs the last ones, as mlx-lm's; "
        "default: shares as even in bytes as they can be).",
    )
    p.add_argument(
        "--verbose",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=True,
        help="Stream text as it is generated.",
    )
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
            f"read {fmt_bytes(s['bytes_per_token'])}/token at the device "
            f"({fmt_bytes(s['bytes_requested_per_token'])} asked)"
            + (
                f" (of which resident weights streamed {fmt_bytes(s['streamed_bytes_per_token'])})"
                if s["streamed_bytes_per_token"]
                else ""
            )
            + (f" at {fmt_bytes(s['read_bytes_per_s'])}/s while reads were in flight" if s["read_bytes_per_s"] else "")
            + f", hit rate {s['hit_rate']:.1%}, "
            f"active units/layer {s['active_per_layer']:.1f}"
            + (
                f"; read ahead {fmt_bytes(s['ahead_bytes_per_token'])}/token "
                f"({fmt_bytes(s['ahead_wasted_bytes_per_token'])} not used), the next layer's router predicted "
                f"{s['prediction_accuracy']:.1%} of the experts routed"
                if s["prediction_accuracy"] is not None
                else ""
            )
            + f"; {s['syncs_per_token']:.0f} host synchronisations a token "
            f"({s['syncs_per_token'] / len(engine.fd.layers):.2f} a layer)"
            + (f", {s['waits_per_token']:.0f} waits for results queued ahead" if s["waits_per_token"] else ""),
            file=out,
        )
    spec = getattr(engine, "speculative", None)
    if spec is not None and spec.passes:
        s, passes = spec.summary(), stats.decode_tokens()
        print(
            f"speculative: {s['passes']} passes, {s['drafted']} drafted, {s['accepted']} accepted "
            f"({s['acceptance']:.1%}), {s['mean_accepted_length']:.2f} tokens a pass; per generated token "
            f"{fmt_bytes(sum(t.bytes_read for t in passes) / s['generated'])} read at the device, "
            f"{1e3 * sum(t.total_s for t in passes) / s['generated']:.2f} ms",
            file=out,
        )
    peak = stats.peak_rss()
    if peak is not None:
        print(
            f"memory: peak RSS {fmt_bytes(peak)} above the baseline of {fmt_bytes(stats.baseline_rss)} "
            f"(interpreter, mlx, mlx-lm, tokenizer); MLX peak {fmt_bytes(mx.get_peak_memory())}",
            file=out,
        )
    forward = getattr(engine, "forward", None)
    if forward is not None:
        why = f" (the native CPU step does not run: {forward.why})" if forward.why else ""
        print(f"forward: {forward.name}{why}", file=out)
    if mx.default_device() == mx.cpu:
        print(
            f"CPU: quantised decode matvecs {'native (kernels/cpu_gemv.c)' if cpu_gemv.available() else 'MLX ops'}, "
            f"BLAS {blas.status}",
            file=out,
        )
    sp = engine.sparsifier
    detail = f" {sp.bits}-bit gate/up" if getattr(sp, "bits", None) else ""
    print(f"selector: {sp.name}{detail}, resident {fmt_bytes(getattr(sp, 'nbytes', 0))} (the plan's extra)", file=out)
    for note in (engine.why, engine.budget_note):
        if note:
            print(note, file=out)
    print(
        engine.plan.describe(
            engine.fd.strides,
            {k: r.n_units for k, r in next(l for l in engine.fd.layers if l).items()},
        ),
        file=out,
    )


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    import mlx.core as mx

    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.exact:
        cpu_gemv.set_int8_activations(False)
    if args.max_tokens == 0 or args.max_tokens < -1:
        print(f"error: --max-tokens {args.max_tokens}: give a positive count, or -1 for no limit", file=sys.stderr)
        return 1
    try:
        group = pipeline.init()  # under mlx.launch with 2+ ranks this process is one pipeline stage
        lead = group is None or group.rank == 0
        model, prompt, error = None, None, None
        try:
            path = model_dir(args.model)
            if lead:
                prompt = _prompt(args, load_tokenizer(FlashDir(path)))
            # the KV cache it will need; -1: the longest the budget holds, where generation stops
            context = len(prompt) + args.max_tokens if lead and args.max_tokens > 0 else None
            layers = pipeline.stage_layers(path, group, args) if group is not None else None
        except (FlashError, ValueError) as e:
            if group is None:
                raise
            error = e
        if group is not None:  # the ranks' plans need rank 0's context (0: the longest the budget holds)
            # (rank 0 loads its tokenizer first)
            context = pipeline.agree(group, error, context or 0, timeout=pipeline.LOAD_WAITS * pipeline.TIMEOUT) or None
        try:
            model, tokenizer = load(
                path,
                memory_budget=args.memory_budget,
                sparsity=args.sparsity,
                window=args.window,
                policy=args.cache_policy,
                density=args.density,
                gamma=args.gamma,
                threads=args.threads,
                direct=not args.cached_io,
                context=context,
                prefetch=False if args.no_prefetch else (True if args.prefetch else None),
                kv_bits=args.kv_bits,
                kv_group_size=args.kv_group_size,
                max_ppl_increase=args.max_ppl_increase,
                draft_model=args.draft_model if lead else None,
                layers=layers,
                backend=args.backend,
                exact=args.exact,
            )
            stage = pipeline.Stage(group, model) if group is not None else None
        except (FlashError, ValueError) as e:
            if group is None:
                raise
            error = e
        if group is not None:
            pipeline.agree(group, error, timeout=pipeline.LOAD_WAITS * pipeline.TIMEOUT)
            stage.share_context()
    except (FlashError, ValueError) as e:
        if model is not None:
            model.flash.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        try:
            if group is None:
                _generate(args, model, tokenizer, prompt)
            else:
                pipeline.run(stage, lambda: _generate(args, model, tokenizer, prompt), args.stats)
        finally:
            model.flash.close()
    except FlashError as e:  # a failed read, a corrupted unit, a prompt longer than the context, a rank lost
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    return 0


def _prompt(args, tokenizer) -> list:
    """The prompt's tokens: the chat template applied unless --ignore-chat-template."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt and args.ignore_chat_template:
        raise ValueError("the prompt is empty: a raw prompt (--ignore-chat-template) needs at least one token")
    if not args.ignore_chat_template and tokenizer.chat_template is not None:
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


def _generate(args, model, tokenizer, prompt):
    from mlx_lm.sample_utils import make_sampler

    response = None
    context = model.flash.context
    # within the budget; a pipeline's: at most the positions a stage's pass takes, in every rank's workspace
    staged = isinstance(model.forward, pipeline.Stage)
    step = model.flash.plan.prefill_step(model.flash.fd, context, model.forward.native, lend=not staged)
    if staged:
        step = min(step, model.forward.max_positions)
    store = None
    if args.prompt_cache_dir and isinstance(model.forward, pipeline.Stage):
        print("[--prompt-cache-dir is not used under a pipeline]", file=sys.stderr)
    elif args.prompt_cache_dir:
        store = PromptStore(args.prompt_cache_dir, identity(model), parse_size(args.prompt_cache_dir_size))
    for response in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        prompt_store=store,
        sampler=make_sampler(args.temp, args.top_p),
        prefill_step_size=step,
        draft_model=model.draft_model,
        prompt_lookup=args.prompt_lookup,
        num_draft_tokens=args.num_draft_tokens,
    ):
        if args.verbose:
            print(response.text, end="", flush=True)
    if args.verbose and response is not None:
        print_response_stats(response)
    if response is not None and response.finish_reason == "length" and response.generation_tokens != args.max_tokens:
        print(
            f"[stopped at the planned context of {context} tokens: what the budget's KV cache holds]", file=sys.stderr
        )
    if args.stats:
        print_stats(model.flash)
        if store is not None:
            print(f"prompt cache: {store.tokens_read} of {len(prompt)} prompt tokens read from {store.dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
