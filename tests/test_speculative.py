"""Speculative decoding: drafts verified k+1 positions a pass give the plain decode's greedy tokens (prompt
lookup, a draft model, on SmolLM2 and a tiny random model, under budgets that stream), the caches end where
plain decoding leaves them, a pass reads its units once, and the draft model's memory is in the plan."""

from mlx_flash.budget import min_budget
from mlx_flash.engine.native_step import MAX_POSITIONS
from mlx_flash.errors import FlashError
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step, speculative_generate_step, stream_generate
from mlx_flash.speculative import AdaptiveDepth, PromptLookup, accept

import mlx.core as mx
import numpy as np
import pytest

native = pytest.mark.native

TEXT = (
    "The quick brown fox jumps over the lazy dog. The committee met on Tuesday to discuss the budget for the "
    "new library, and agreed that the reading room would open in March."
)


# -- drafters ------------------------------------------------------------------------------------------


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    p = PromptLookup(max_ngram=3)
    t = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert p.propose(t, 3) == [4, 5, 9]  # "2 3" was last followed by 7, but the longest match "1 2 3" wins
    assert p.propose(t + [4], 2) == [5, 9]  # grown by one token: the index follows
    assert p.propose([8, 2, 3, 6, 2, 3], 2) == [6, 2]  # another text; "2 3" latest at 1 (followed by 6)
    assert p.propose([5, 6, 7], 4) == []  # another text: no n-gram repeats
    assert p.propose([1] * 6, 3) == [1, 1, 1]  # the latest "1 1 1" has one token after it: the first has three
    assert p.propose([1] * 4, 5) == [1]  # only tokens already written: never past the end
    assert p.propose(t, 0) == []
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_adaptive_depth_from_acceptance_and_pass_costs():
    """Deep when passes cost about the same at any width and drafts land; shallow when a pass costs its width or
    drafts fail; deeper widths get tried (extrapolated) before they are measured."""
    flat = AdaptiveDepth(8)
    for _ in range(10):
        flat.update(4, 4, 1.0)  # every draft accepted, width 5 costs what width 1 does
        flat.update(0, 0, 1.0)
    assert flat.depth == 8
    steep = AdaptiveDepth(8)
    for w in range(1, 9):
        steep.update(w - 1, (w - 1) // 2, 0.1 * w)  # a pass costs its width; half the drafts land
    assert steep.depth <= 2
    failing = AdaptiveDepth(8)
    for _ in range(20):
        failing.update(4, 0, 1.1)  # a little dearer than one position
        failing.update(0, 0, 1.0)
    assert failing.depth == 1
    fixed = AdaptiveDepth(4, adaptive=False)
    fixed.update(4, 0, 1.0)
    assert fixed.depth == 4
    with pytest.raises(ValueError):
        AdaptiveDepth(0)
    assert accept([5, 6, 7], np.array([5, 6, 9, 1])) == 2 and accept([], np.array([3])) == 0


class Fixed:
    """A drafter proposing `tokens` after every text (mostly wrong): exercises rejection and cache trims."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, tokens, n):
        return self.tokens[:n]


# -- against plain decoding ----------------------------------------------------------------------------


def _streaming(path, **kw):
    """The model under a budget that caches a third of the FFN (misses every token)."""
    from mlx_flash.loader import kv_size_of, load

    fd = FlashDir(path)
    return load(path, memory_budget=min_budget(fd, 256, kv_size_of(fd)) + fd.ffn_bytes // 3, context=256, **kw)


def _prompt(tok):
    return mx.array(tok.encode("Copy this text: " + TEXT + "\nCopy: " + TEXT[:40]))


def _plain(model, prompt, n):
    return [t for t, _ in generate_step(prompt, model, max_tokens=n)]


@pytest.mark.parametrize("long_prompt", [False, True])
def test_prompt_lookup_gives_plain_greedy_tokens_on_smollm2(smol, long_prompt):
    """Tokens and log-probabilities bit for bit those of plain decoding: a short prompt (a native pass where the
    native step runs) and one longer than native_step.MAX_POSITIONS (MLX's forward), after which the first step
    reads as every later one."""
    from mlx_flash.loader import load

    model, tok = load(smol, memory_budget="50%", context=1200)  # the user's budget: the LM head streams too
    try:
        assert model.flash.plan.streamed
        prompt = _prompt(tok)
        if long_prompt:  # (MLX's forward takes prompts of any length: a few chunks of one suffice there)
            repeat = 29 if model.forward.native else 7
            prompt = mx.array(tok.encode("Copy this text: " + TEXT * repeat + "\nCopy: " + TEXT[:40]))
            assert len(prompt) > (MAX_POSITIONS if model.forward.native else 256)
        want = [(t, np.array(lp)) for t, lp in generate_step(prompt, model, max_tokens=24)]
        model.flash.reset()
        reads0 = model.flash.stats.device_bytes()
        out = list(speculative_generate_step(prompt, model, PromptLookup(), max_tokens=24))
        assert [t for t, _, _ in out] == [t for t, _ in want]
        assert all(np.array_equal(np.array(lp), w) for (_, lp, _), (_, w) in zip(out, want))
        drafted = [d for _, _, d in out]
        assert any(drafted) and not all(drafted[1:])  # drafts accepted and rejected both
        model.flash.stats.end()
        assert model.flash.stats.device_bytes() > reads0  # it streamed
    finally:
        model.flash.close()


def _kv(cache):
    """A layer cache's keys and values as numpy arrays, up to its offset (any cache kind)."""
    keys, values = cache.state[:2]
    return np.array(keys[..., : cache.offset, :]), np.array(values[..., : cache.offset, :])


def test_rejected_drafts_leave_the_cache_of_plain_decoding(smol):
    """A caller's prompt cache after speculative decoding with wrong drafts holds exactly what plain decoding's
    holds (every yielded token, rejected positions trimmed), bit for bit in dense mode."""
    model, tok = _streaming(smol)
    try:
        prompt = _prompt(tok)
        plain_cache, spec_cache = model.make_cache(), model.make_cache()
        want = [t for t, _ in generate_step(prompt, model, max_tokens=12, prompt_cache=plain_cache)]
        model.flash.reset()
        got = [
            t
            for t, _, _ in speculative_generate_step(
                prompt, model, Fixed([want[1], 7, 7, 7]), max_tokens=12, prompt_cache=spec_cache, adaptive_draft=False
            )
        ]
        assert got == want
        for a, b in zip(plain_cache, spec_cache):
            assert a.offset == b.offset == len(prompt) + 12
            assert all(np.array_equal(x, y) for x, y in zip(_kv(a), _kv(b)))
    finally:
        model.flash.close()


def test_a_verification_pass_reads_its_units_once(smol):
    """Dense at a third cached: a pass of 9 positions reads the bytes of a single-token pass (the same uncached
    units, once), counted at the device."""
    model, tok = _streaming(smol, sparsity="dense")
    try:
        cache = model.make_cache()
        model.forward(_prompt(tok).tolist(), cache, prompt=True)
        one, nine = [], []
        for widths, out in (([1] * 3, one), ([9] * 3, nine)):
            for w in widths:
                before = model.flash.stats.device_bytes()
                logits = model.forward(list(range(100, 100 + w)), cache)
                assert logits.shape == (1, w, model.args.vocab_size)
                out.append(model.flash.stats.device_bytes() - before)
        assert min(one) > 0 and max(nine) <= 1.05 * max(one), (one, nine)
    finally:
        model.flash.close()


def test_tiny_model_gives_plain_greedy_tokens(tiny, tmp_path):
    from mlx_flash.convert import convert
    from mlx_flash.loader import kv_size_of, load

    _, src, _ = tiny
    path = convert(str(src), tmp_path / "flash", progress=False)
    fd = FlashDir(path)
    model, tok = load(path, memory_budget=min_budget(fd, 128, kv_size_of(fd)) + fd.ffn_bytes // 3, context=128)
    try:
        prompt = mx.array(tok.encode("abc abc abc abc abc"))
        want = _plain(model, prompt, 24)
        for drafter in (PromptLookup(), Fixed([want[1], want[2], 3])):
            model.flash.reset()
            assert [t for t, _, _ in speculative_generate_step(prompt, model, drafter, max_tokens=24)] == want
    finally:
        model.flash.close()


# -- draft models ----------------------------------------------------------------------------------------


def test_draft_model_is_in_the_plan_and_gives_plain_tokens(smol):
    from mlx_flash.loader import kv_size_of, load

    fd = FlashDir(smol)
    budget = min_budget(fd, 256, kv_size_of(fd)) + fd.model_bytes + fd.ffn_bytes // 3
    plain, tok = load(smol, memory_budget=budget, context=256)
    extra = plain.flash.plan.extra
    plain.flash.close()
    model, _ = load(smol, memory_budget=budget, context=256, draft_model=smol)
    try:
        draft = model.draft_model
        assert draft is not None and model.flash.plan.extra - extra >= fd.model_bytes  # its weights, inside
        prompt = _prompt(tok)
        want = _plain(model, prompt, 16)  # plain decoding with the same plan (the draft's memory taken out)
        model.flash.reset()
        responses = list(stream_generate(model, tok, prompt.tolist(), max_tokens=16, draft_model=draft))
        assert [r.token for r in responses] == want
        spec = model.flash.speculative.summary()
        assert spec["accepted"] > 0 and spec["generated"] == 15  # (the first token comes from the prompt pass)
    finally:
        model.flash.close()
        model.draft_model.flash.close()


def test_bad_speculative_requests_raise(tiny, tmp_path):
    from mlx_flash.convert import convert
    from mlx_flash.loader import load
    from mlx_flash.models.tiny import make_tiny_model_dir

    from mlx_lm.models.cache import RotatingKVCache

    _, src, _ = tiny
    path = convert(str(src), tmp_path / "flash", progress=False)
    model, tok = load(path, context=64)
    try:
        prompt = mx.array(tok.encode("abc"))
        with pytest.raises(ValueError, match="one draft source"):
            list(stream_generate(model, tok, prompt.tolist(), max_tokens=4, prompt_lookup=True, draft_model=model))
        with pytest.raises(ValueError, match="trimmable"):  # a full rotating cache cannot take tokens back
            rotating = [RotatingKVCache(max_size=4) for _ in model.layers]
            list(
                speculative_generate_step(
                    mx.array(tok.encode("abc abc abc")), model, PromptLookup(), max_tokens=4, prompt_cache=rotating
                )
            )
    finally:
        model.flash.close()
    other = convert(
        str(make_tiny_model_dir("llama", tmp_path / "other", vocab_size=300)), tmp_path / "oflash", progress=False
    )
    with pytest.raises(FlashError, match="same tokenizer"):
        load(path, context=64, draft_model=other)


def test_generate_with_a_draft_model_holds_its_budget_under_a_hard_cap(smol, generate_capped):
    """`generate --draft-model` under a cgroup limit of the budget + the interpreter's baseline: it finishes, its
    peak RSS above that baseline is inside the budget, and it drafted."""
    import re

    budget = FlashDir(smol).model_bytes * 3 // 2  # the draft (the same weights) and the target's resident floor
    r, peak = generate_capped(
        smol, budget, "--draft-model", str(smol), "--max-tokens", "24", "--prompt", "Copy this text: " + TEXT
    )
    assert r.ok, r.summary() + "\n" + r.stderr
    assert peak, r.stdout
    assert 0 < peak <= budget, r.stdout
    assert re.search(r"speculative: \d+ passes, [1-9]\d* drafted", r.stdout), r.stdout


@native
@pytest.mark.usefixtures("float_activations")
def test_a_pass_computes_each_position_over_its_own_units(smol):
    """A lossy selector: the pass reads the union of its positions' units, and each position's FFN is that of
    its own units (the union would give another output)."""
    from mlx_flash.loader import load

    model, _ = load(smol, sparsity="oracle", density=0.3, context=64)
    try:
        e, bias = model.flash, model.layers[3].mlp._bias
        x = np.random.default_rng(0).standard_normal((4, model.args.hidden_size)).astype(np.float32)
        together = e.ffn_row(3, x, bias)
        alone = np.stack([e.ffn_row(3, v, bias) for v in x])
        assert np.allclose(together, alone, rtol=1e-4, atol=1e-4)
        everything = load(smol, sparsity="dense", context=64)[0]
        try:
            dense = np.stack([everything.flash.ffn_row(3, v, bias) for v in x])
            assert not np.allclose(alone, dense, rtol=1e-2, atol=1e-2)  # the selector drops units that matter
        finally:
            everything.flash.close()
    finally:
        model.flash.close()
