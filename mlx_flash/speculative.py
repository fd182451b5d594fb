"""Speculative decoding over streamed weights: draft k tokens cheaply, verify them in one pass of k+1
positions, keep the accepted prefix. A flash pass reads each needed FFN unit once for all its positions
(native_step.HostDecoder, neurons.NeuronEngine._step), so when a token is bound by its reads, several tokens come
for the bytes of one.

    drafter.prefill(prompt)      once, before the first token (a draft model reads the prompt)
    drafter.propose(tokens, n)   up to n draft tokens following `tokens` (the prompt and the text so far)
    one pass over [y, d_1..d_k]  the target's logits at k+1 positions
    accept d_i while it equals the target's own token at position i (greedy: its argmax; sampling: its sample,
                                 mlx-lm's rule), then the target's token at the first mismatch
    trim the rejected drafts' keys and values from the caches (mlx-lm's trim_prompt_cache)

Every token yielded is the target's own choice given the tokens before it, so greedy output is the plain
decode's and sampled output has its distribution. Drafters:

    PromptLookup   n-gram matches in the prompt and the text so far (no model, no memory)
    ModelDrafter   a small model with the same tokenizer, greedy, on its own trimmable cache
    AdaptiveDepth  the draft depth from the acceptance seen so far and the measured cost of passes
"""

from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np


class PromptLookup:
    """Draft the tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (max_ngram down to min_ngram tokens) of the text so far: prompt lookup decoding (Saxena 2023), the
    n-gram proposer of vLLM and transformers. Where the latest occurrence is too recent to have n tokens
    after it (a text repeating a short cycle), the first one is used if more follow it. The index grows
    incrementally: each call indexes only the n-grams that are new since the last."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.reset()

    def reset(self):
        self._index: Dict[tuple, int] = {}  # n-gram -> the end (exclusive) of its latest occurrence
        self._first: Dict[tuple, int] = {}  # ... and of its first
        self._tokens: List[int] = []
        self._indexed = 0  # ends below this are in the index

    def propose(self, tokens: List[int], n: int) -> List[int]:
        if tokens[: len(self._tokens)] != self._tokens[: len(tokens)] or len(tokens) < len(self._tokens):
            self.reset()  # another text (a new request): start over
        self._tokens = list(tokens)
        t = self._tokens
        for end in range(max(self._indexed, 1), len(t)):  # n-grams ending at `end` with a token after them
            for k in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(t[end - k : end])
                self._index[key] = end
                self._first.setdefault(key, end)
        self._indexed = max(self._indexed, len(t))
        if n <= 0:
            return []
        for k in range(min(self.max_ngram, len(t) - 1), self.min_ngram - 1, -1):
            key = tuple(t[len(t) - k :])
            end = self._index.get(key)
            if end is not None:
                return t[end : end + n] if len(t) - end >= n else t[self._first[key] : self._first[key] + n]
        return []

    def prefill(self, tokens: List[int]) -> None:
        self.propose(tokens, 0)  # index the prompt


class ModelDrafter:
    """Greedy drafts from a small resident model with the target's tokenizer (mlx-lm's draft model), on its own
    KV cache; after each pass its cache is trimmed back to the accepted tokens."""

    name = "draft-model"

    def __init__(self, model, cache=None):
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        self.model = model
        self.cache = cache if cache is not None else make_prompt_cache(model)
        if not can_trim_prompt_cache(self.cache):
            raise ValueError("the draft model's cache cannot be trimmed (a rotating or quantised cache?)")
        self._fed: List[int] = []  # the tokens in the draft cache

    def _feed(self, tokens: List[int]) -> mx.array:
        """Run `tokens` through the draft model (a flash model's pass, engine/forward.py; a stock model's call); the
        last position's logits."""
        forward = getattr(self.model, "forward", None)
        if forward is not None:
            logits = forward(tokens, self.cache, prompt=True)[:, -1, :]
        else:
            logits = self.model(mx.array(tokens, dtype=mx.uint32)[None], cache=self.cache)[:, -1, :]
        self._fed += tokens
        return logits

    def prefill(self, tokens: List[int]) -> None:
        """Feed the prompt (all but its last token) while the target reads its own: not on the first draft's clock."""
        if len(tokens) > 1:
            self._feed(tokens[:-1])

    def propose(self, tokens: List[int], n: int) -> List[int]:
        from mlx_lm.models.cache import trim_prompt_cache

        common = 0  # the draft cache keeps the longest prefix it shares with `tokens`
        for a, b in zip(self._fed, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is fed again: its logits are needed
        trim_prompt_cache(self.cache, len(self._fed) - common)
        del self._fed[common:]
        if n <= 0:
            return []
        logits = self._feed(tokens[common:])
        out = []
        for i in range(n):
            y = int(mx.argmax(logits, axis=-1).item())
            out.append(y)
            if i + 1 < n:
                logits = self._feed([y])
        return out


class AdaptiveDepth:
    """How many tokens to draft next (up to `max_depth`), from what passes cost and how often drafts land.

    With a draft token accepted at rate a (each one given the ones before it), k drafts yield on average
    E(k) = (1 - a^(k+1)) / (1 - a) tokens a pass; a pass of w positions takes t(w), measured as passes run
    (drafting included: a draft model's steps; a running mean per width; an unseen width is interpolated, or
    extrapolated along the last two seen ones, so deeper drafts get tried). The depth is the k that maximises
    E(k) / t(k + 1): deep when verification is nearly free (a pass bound by its reads) and drafts keep landing,
    one or two when passes cost their width or drafts fail."""

    def __init__(self, max_depth: int, adaptive: bool = True, prior_acceptance: float = 0.5):
        if max_depth < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {max_depth}")
        self.max_depth, self.adaptive = max_depth, adaptive
        self.depth = max_depth
        self.drafted, self.accepted = 2.0, 2.0 * prior_acceptance  # a weak prior, then the counts (decayed)
        self.cost: Dict[int, float] = {}  # width -> mean seconds a pass

    def update(self, drafted: int, accepted: int, seconds: Optional[float] = None) -> None:
        """After a pass that verified `drafted` tokens (of which `accepted` were kept) in `seconds`."""
        if seconds is not None:
            w = drafted + 1
            self.cost[w] = seconds if w not in self.cost else 0.7 * self.cost[w] + 0.3 * seconds
        if not self.adaptive or drafted == 0:
            return
        self.drafted, self.accepted = 0.9 * self.drafted + drafted, 0.9 * self.accepted + accepted
        self.depth = self.best()

    def _time(self, w: int) -> float:
        known = sorted(self.cost)
        if w in self.cost or len(known) < 2:
            return self.cost.get(w, self.cost[known[0]] if known else 1.0)
        lo, hi = [k for k in known if k < w], [k for k in known if k > w]
        a, b = (lo[-1], hi[0]) if lo and hi else ((known[-2], known[-1]) if lo else (known[0], known[1]))
        return max(1e-9, self.cost[a] + (self.cost[b] - self.cost[a]) * (w - a) / (b - a))

    def best(self) -> int:
        """The depth with the most tokens a second (the shallowest of equals)."""
        a = min(0.99, self.accepted / self.drafted)
        best, top = 1, 0.0
        for k in range(1, self.max_depth + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / self._time(k + 1)
            if gain > top * (1 + 1e-6):
                best, top = k, gain
        return best


class SpeculativeStats:
    """What speculation did over a generation: passes, drafted, accepted, generated tokens."""

    def __init__(self):
        self.passes = self.drafted = self.accepted = self.generated = 0

    def add(self, drafted: int, accepted: int, emitted: int) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.generated += emitted

    def summary(self) -> dict:
        return dict(
            passes=self.passes,
            drafted=self.drafted,
            accepted=self.accepted,
            generated=self.generated,
            acceptance=self.accepted / self.drafted if self.drafted else 0.0,
            mean_accepted_length=self.generated / self.passes if self.passes else 0.0,
        )


def make_drafter(prompt_lookup: bool = False, draft_model=None, max_ngram: int = 3):
    """The drafter the flags ask for (None: plain decoding)."""
    if prompt_lookup and draft_model is not None:
        raise ValueError("choose one draft source: --prompt-lookup or --draft-model")
    if prompt_lookup:
        return PromptLookup(max_ngram=max_ngram)
    return ModelDrafter(draft_model) if draft_model is not None else None


def accept(draft: List[int], targets: np.ndarray) -> int:
    """How many draft tokens the target's own tokens at the same positions confirm (the accepted prefix)."""
    n = 0
    while n < len(draft) and int(targets[n]) == draft[n]:
        n += 1
    return n
