"""The generation loop (`mlx_flash.generate`: `generate_step`, `stream_generate`): mlx-lm's tokens, log-probs
and responses, two forward passes fewer before the first token, and a caller's prompt cache left holding
every token it was given, as mlx-lm leaves it (its server stores the cache under prompt + reply)."""

import importlib
import math
import threading

from mlx_flash.budget import min_budget
from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step, stream_generate
from mlx_flash.loader import kv_size_of, load
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

PROMPT = [1, 5, 9, 33, 7, 100, 3] * 4
CONTEXT = 256


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    path = convert(str(make_tiny_model_dir("llama", root / "src", vocab_size=257)), root / "flash", progress=False)
    fd = FlashDir(path)
    # dense streaming with caches for a third of the FFN: every pass reads
    model, tokenizer = load(
        path,
        memory_budget=min_budget(fd, CONTEXT, kv_size_of(fd)) + fd.ffn_bytes // 3,
        sparsity="dense",
        context=CONTEXT,
    )
    yield model, tokenizer
    model.flash.close()


def run(step_fn, model, n, **kwargs):
    tokens, logprobs = zip(*step_fn(mx.array(PROMPT), model, max_tokens=n, **kwargs))
    return list(tokens), np.stack([np.array(lp) for lp in logprobs])


@pytest.mark.parametrize("prefill_step_size", [5, 64])
def test_tokens_and_logprobs_are_mlx_lm_s(flash, prefill_step_size):
    model, _ = flash
    for kwargs in ({}, {"logits_processors": make_logits_processors(repetition_penalty=1.5)}):
        ours = run(generate_step, model, 12, prefill_step_size=prefill_step_size, **kwargs)
        theirs = run(mlx_lm_generate_step, model, 12, prefill_step_size=prefill_step_size, **kwargs)
        assert ours[0] == theirs[0]
        np.testing.assert_allclose(ours[1], theirs[1], atol=1e-4)


def passes_before_first_token(step_fn, model, step):
    stats = model.flash.stats
    model.flash.reset()  # cold caches: every pass reads
    stats.reset()
    gen = step_fn(mx.array(PROMPT), model, max_tokens=4, prefill_step_size=step)
    next(gen)
    stats.end()
    passes, read = len(stats.tokens), stats.device_bytes()
    gen.close()
    return passes, read


def test_the_first_token_follows_the_prompt_s_own_passes(flash):
    """mlx-lm gives the prompt's last token a pass of its own and computes the second token before
    yielding the first; here the first token comes after ceil(prompt / step) passes and reads less."""
    model, _ = flash
    ours, ours_read = passes_before_first_token(generate_step, model, 8)
    theirs, theirs_read = passes_before_first_token(mlx_lm_generate_step, model, 8)
    assert ours == math.ceil(len(PROMPT) / 8) == theirs - 2
    assert 0 < ours_read < theirs_read


@pytest.mark.parametrize("stop_after", [2, None])
def test_a_prompt_cache_holds_every_token_and_continues_like_a_fresh_prefill(flash, stop_after):
    model, tokenizer = flash
    cache = make_prompt_cache(model)
    reply = []
    for r in stream_generate(model, tokenizer, PROMPT, max_tokens=6, prompt_cache=cache, prefill_step_size=8):
        reply.append(r.token)
        if len(reply) == stop_after:
            break  # a client that stops reading: the generator is closed here
    assert cache[0].offset == len(PROMPT) + len(reply)
    turn = [4, 8, 15]
    cached = [r.token for r in stream_generate(model, tokenizer, turn, max_tokens=6, prompt_cache=cache)]
    fresh = [r.token for r in stream_generate(model, tokenizer, PROMPT + reply + turn, max_tokens=6)]
    assert cached == fresh


def test_refusals(flash):
    model, tokenizer = flash
    with pytest.raises(ValueError, match="one draft source"):
        next(stream_generate(model, tokenizer, PROMPT, draft_model=model, prompt_lookup=True))
    with pytest.raises(ValueError, match="empty"):
        next(generate_step(mx.array([], dtype=mx.int32), model))


def test_the_prompt_s_head_runs_on_its_last_position_only(flash, monkeypatch):
    """The logits of a prompt chunk's other positions are never used: [positions, vocab] is not computed."""
    model, _ = flash
    tied = getattr(model, "lm_head", None) is None
    owner, name = (model.model.embed_tokens, "as_linear") if tied else (model, "lm_head")
    head, shapes = getattr(owner, name), []
    monkeypatch.setattr(owner, name, lambda x: shapes.append(x.shape) or head(x))
    next(generate_step(mx.array(PROMPT), model, prefill_step_size=64))
    assert [s[1] for s in shapes] == [1]


def test_a_model_loaded_in_one_thread_generates_in_another(tmp_path):
    """mlx-lm's server generates in its own thread and MLX's streams are per thread: nothing the load
    leaves lazy (here OPT's resident FFN biases) may be evaluated there first."""
    path = convert(str(make_tiny_model_dir("opt", tmp_path / "src")), tmp_path / "flash", progress=False)
    model, _ = load(path, sparsity="dense")
    try:
        out = {}

        def generate():
            try:
                out["tokens"] = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=4)]
            except Exception as e:  # noqa: BLE001  (reported below)
                out["error"] = e

        thread = threading.Thread(target=generate)  # first: nothing evaluated in this thread since the load
        thread.start()
        thread.join()
        assert out == {"tokens": [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=4)]}
    finally:
        model.flash.close()


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_generation_tps_is_decode_steps_over_their_time(monkeypatch, tmp_path):
    """The prompt's pass (5 s) makes the first token; each later token is one decode step (2 s): 8 tokens are
    7 steps in 14 s, 0.5 tokens/s (not 8 / 14)."""
    generation = importlib.import_module("mlx_flash.generate")  # (the attribute mlx_flash.generate is the function)
    from mlx_flash.models.tiny import save_tiny_tokenizer

    from mlx_lm.utils import load_tokenizer

    save_tiny_tokenizer(tmp_path)
    clock = _Clock()

    def steps(prompt, model, max_tokens, **kwargs):
        clock.now += 5.0
        for i in range(max_tokens):
            if i:
                clock.now += 2.0
            yield 65 + i, mx.zeros(4)

    monkeypatch.setattr(generation, "time", clock)
    monkeypatch.setattr(generation, "generate_step", steps)
    responses = list(stream_generate(object(), load_tokenizer(tmp_path), [1, 2, 3], max_tokens=8))
    last = responses[-1]
    assert last.generation_tokens == 8 and last.prompt_tps == pytest.approx(3 / 5.0)
    assert last.generation_tps == pytest.approx(7 / 14.0)
    assert responses[0].generation_tps == 0.0  # no decode step yet
    assert generation.decode_tps(7, 14.0) == 0.5 and generation.decode_tps(0, 0.0) == 0.0
