"""The generation loop for flash models: mlx-lm's `generate_step`, `stream_generate` and `generate` (same
arguments, yields and responses) with two forward passes fewer before the first token (`generate_step`).
`mlx_flash.generate` / `mlx_flash.stream_generate` are these; `python -m mlx_flash.generate` is the command."""

import sys
import time
from contextlib import contextmanager


def generate_step(prompt, model, *, max_tokens: int = 256, sampler=None, logits_processors=None,
                  prompt_cache=None, prefill_step_size: int = 2048, kv_bits=None, kv_group_size: int = 64,
                  quantized_kv_start: int = 0, prompt_progress_callback=None, max_kv_size=None,
                  input_embeddings=None, stream=None):
    """mlx-lm's `generate_step` (same arguments and yields) with two forward passes fewer before the
    first token. A flash pass reads its FFN units on the host, layer by layer, so mlx-lm's two overlaps
    only cost passes: its prompt's last token gets a pass of its own (here it ends the last prompt
    chunk, whose head runs on that position alone) and it computes each token before yielding the one
    before (here after). A `prompt_cache` passed in ends holding every yielded token, as with mlx-lm
    (its server stores it under the prompt + reply): the last one is fed when the generator closes."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    if input_embeddings is not None:
        raise ValueError("input embeddings are not supported by mlx_flash")
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    own_cache = prompt_cache is None
    if own_cache:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    sampler = sampler or greedy_sampler
    progress = prompt_progress_callback or (lambda *_: None)
    history = None  # the tokens so far, for the logits processors

    def forward(tokens, logits: bool):
        """Run `tokens` through the model into the cache; the last position's logprobs if asked."""
        nonlocal history
        if logits_processors:
            history = tokens if history is None else mx.concat([history, tokens])
        with mx.stream(stream or generation_stream), _head_on_last_position(model, len(tokens) > 1 and logits):
            decoder = getattr(model, "decoder", None)  # a flash model's native CPU decode step
            if decoder is not None and decoder.applies(tokens, prompt_cache):
                out = decoder(tokens.item(), prompt_cache)
            else:
                out = model(tokens[None], cache=prompt_cache)
            maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits)
            if not logits:  # the head's output is never evaluated
                mx.eval([c.state for c in prompt_cache])
                return None
            out = out[:, -1, :]
            for processor in logits_processors or ():
                out = processor(history, out)
            logprobs = out - mx.logsumexp(out, keepdims=True)
            y = sampler(logprobs)
            mx.eval(y, logprobs)
            return y, logprobs.squeeze(0)

    total, done = len(prompt), 0
    progress(0, total)
    while total - done > prefill_step_size:
        forward(prompt[done : done + prefill_step_size], logits=False)
        done += prefill_step_size
        progress(done, total)
        mx.clear_cache()
    y, logprobs = forward(prompt[done:], logits=True)
    progress(total, total)
    n, unfed = 0, None
    try:
        while True:
            unfed = y
            yield y.item(), logprobs
            n += 1
            if n == max_tokens:
                break
            unfed = None  # from here the pass below owns it (a failed pass is not retried)
            y, logprobs = forward(y, logits=True)
            if n % 256 == 0:
                mx.clear_cache()
    finally:
        if unfed is not None and not own_cache:
            forward(unfed, logits=False)


@contextmanager
def _head_on_last_position(model, on: bool):
    """mlx-lm's models apply their head to `model.model`'s output: give it the last position only.
    The prompt's other logits are unused, and [positions, vocab] floats need not fit a budget."""
    inner = getattr(model, "model", None) if on else None
    if inner is None:
        yield
        return
    model.model = _LastPosition(inner)
    try:
        yield
    finally:
        model.model = inner


class _LastPosition:
    """`inner` (the model's body) returning its last position; its attributes (a tied head) as they are."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)[:, -1:]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, draft_model=None, **kwargs):
    """mlx-lm's `stream_generate` (same arguments and `GenerationResponse`s) on `generate_step` above;
    closes the flash model's stats at the end."""
    import mlx.core as mx
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if draft_model is not None:
        raise ValueError("draft models are not supported by mlx_flash (a second model outside the budget)")
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    kwargs.pop("num_draft_tokens", None)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt, add_special_tokens=tokenizer.bos_token is None
                                  or not prompt.startswith(tokenizer.bos_token))
    prompt = mx.array(prompt)
    detokenizer = tokenizer.detokenizer
    tokens = generate_step(prompt, model, max_tokens=max_tokens, **kwargs)

    def response(finish=None):
        return GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=False, prompt_tokens=prompt.size,
            prompt_tps=prompt_tps, generation_tokens=n + 1, generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish)

    try:
        tic = time.perf_counter()
        for n, (token, logprobs) in enumerate(tokens):
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
    print(f"\n{'=' * 10}\nPrompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec\n"
          f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec\n"
          f"Peak memory: {response.peak_memory:.3f} GB", file=out)
