"""The forward pass every feature is written against, and its implementation in MLX's own ops.

A pass takes one or several sequences at once, each with its new tokens and its own caches (one per layer, of any
kind mlx-lm has) at its own position:

    forward(tokens, cache, prompt)   one sequence: logits [1, m, vocab] (a prompt: [1, 1, vocab] of its last token)
    forward.run(seqs, prompt)        several, [(token ids, caches)]: each one's last logits [len(seqs), vocab]
    forward.batch(tokens, cache)     mlx-lm's BatchGenerator's call: run() over a batch's per-sequence caches
    forward.stage(x, cache, prompt)  a pipeline stage's share: from token ids (where it holds the embedding) or the
                                     rows the stage before sent, to rows for the next (float32 [m, hidden]) or logits

Continuous batching, pipeline stages, speculative verification and chunked prompts use these and nothing else.
Two implementations compute them:

    MLXForward    mlx-lm's own modules with the flash FFN, expert and streamed modules inside: every backend MLX
                  has (Metal, CUDA, the CPU), any number of positions, any cache kind
    HostDecoder   (native_step.py) the native CPU kernels: llama-style layers on host rows and host KV caches;
                  `Auto` runs it beneath the same calls where it applies, MLXForward elsewhere

Several sequences in one MLX pass: their rows are laid end to end, each layer's mixers (its attention, or any module
it hands its cache) run with each sequence's own cache and mask (`Segments`), and everything else computes all rows
at once, so a unit read from flash serves every sequence. A sequence's rows compute as in a pass of their own
wherever a product's rows do not depend on each other (compute.rows.independent); where they do (a float matmul on
the CPU, any matmul on a GPU) the product runs per sequence (`per_sequence`, and the engines). A mixer runs once
over the sequences of a length, stacked, where that computes each as alone (`_call_stacked`: its projections and RoPE
once, each sequence's keys and attention its own), else once per sequence.
"""

import copy
import inspect
import os
from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import KVCache

from ..compute import rows as row_rules
from .resident import EVERY_ROW, Absent, Streamed

BACKENDS = ("auto", "mlx", "native")


def backend_name(backend: Optional[str] = None) -> str:
    """The forward implementation asked for: `backend`, else MLX_FLASH_BACKEND, else "auto"."""
    name = backend or os.environ.get("MLX_FLASH_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: choose from {', '.join(BACKENDS)}")
    return name


class Forward:
    """The pass interface (module doc). `batch` is written once here, on `run`."""

    name = "?"
    native = False  # whether the native CPU step computes its passes (where it applies)
    why = None  # why the native step does not run (MLXForward), for --stats
    # Each sequence's rows compute as in a pass of that sequence alone, whatever else the pass holds ...
    sequences_alone = True
    # ... and each row as in a pass of its own (a prompt's rows then compute alike however its chunks are cut)
    rows_alone = False

    def batch(self, tokens: mx.array, cache: list, run=None) -> mx.array:
        """Logits [B, 1, vocab] of the last token of each sequence of a batch (tokens [B, L], right-padded where the
        caches were prepared with lengths: SequenceBatch) in one pass: every unit read once for all, each
        sequence at its own position of its own caches, its logits what a pass of it alone gives. `run(seqs,
        prompt)` computes the pass (default: `self.run`; the server's adds other sequences to it: engine.batching)."""
        ids = [row[:m] for row, m in zip(tokens.tolist(), cache[0].lengths(tokens.shape[1]))]
        for c in cache:
            c.advance(tokens.shape[1])
        live = [i for i, row in enumerate(ids) if row]  # (right padding can leave a sequence none)
        for c in cache:
            c.own(live)
        last = (run or self.run)([(ids[i], [c.caches[i] for c in cache]) for i in live], tokens.shape[1] > 1)
        logits = np.zeros((len(ids), last.shape[-1]), np.float32)
        logits[live] = last
        return mx.array(logits)[:, None]


class SequenceBatch:
    """One layer's caches of a batch of sequences, as mlx-lm's BatchGenerator merges them (each cache class's `merge`:
    `Batchable`): each sequence keeps its own cache, of any kind, which a pass writes at that sequence's own position,
    so a sequence joins, leaves or is stored without moving the others' keys. A prompt chunk of right-padded prompts
    (`prepare(lengths=...)`) computes each sequence's own tokens only."""

    def __init__(self, caches: list):
        self.caches = list(caches)
        self._lent = [False] * len(self.caches)  # handed out by extract: copied before the batch writes there again
        self._left = None  # tokens of each sequence still to come in the padded passes, when prepared

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and any(left_padding):
            raise ValueError("SequenceBatch: sequences are not left-padded")
        self._left = None if lengths is None else list(lengths)

    def finalize(self):
        self._left = None

    def lengths(self, n: int) -> List[int]:
        """Each sequence's own tokens among the next pass's n."""
        return [n] * len(self.caches) if self._left is None else [min(n, left) for left in self._left]

    def advance(self, n: int):
        if self._left is not None:
            self._left = [max(0, left - n) for left in self._left]

    def filter(self, keep: List[int]):
        self.caches = [self.caches[i] for i in keep]
        self._lent = [self._lent[i] for i in keep]

    def extend(self, other: "SequenceBatch"):
        self.caches += other.caches
        self._lent += other._lent

    def __deepcopy__(self, memo):
        """A batch that shares its sequences' caches: mlx-lm copies a batch only to split it (PromptProcessingBatch's
        split, each sequence then kept on one side), and a deep copy would double every sequence's keys and values."""
        out = SequenceBatch(self.caches)
        out._lent, out._left = list(self._lent), None if self._left is None else list(self._left)
        return out

    def extract(self, idx: int):
        """Sequence idx's cache, handed out (to the server's prompt cache): the batch copies it before it writes there
        again, so a sequence that finishes leaves without a copy of its keys and values."""
        self._lent[idx] = True
        return self.caches[idx]

    def own(self, live: List[int]):
        """Copies of the caches of sequences `live` that were handed out, before a pass writes them."""
        for i in live:
            if self._lent[i]:
                self.caches[i] = copy.deepcopy(self.caches[i])
                self._lent[i] = False

    @property
    def state(self):
        return ()  # each sequence's cache is evaluated by the pass that writes it

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


class Batchable:
    """A cache class whose batches (mlx-lm's `merge`) are SequenceBatches: batched passes write each sequence's own."""

    @classmethod
    def merge(cls, caches: list) -> SequenceBatch:
        return SequenceBatch(caches)


class FloatKVCache(Batchable, KVCache):
    """mlx-lm's KVCache, batched per sequence."""


class HalfKVCache(Batchable, KVCache):
    """mlx-lm's KVCache holding float16 keys and values (loader.half_kv: half the memory, each key rounded once as it
    is stored), given back in the activations' dtype; batched per sequence."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
        return k.astype(keys.dtype), v.astype(values.dtype)


class QuantizedKVCache(Batchable, mlx_lm_cache.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache (--kv-bits), batched per sequence."""


# -- several sequences through mlx-lm's modules ---------------------------------------------------------------------


class NotSegmentable(RuntimeError):
    """A model body asked a pass's per-sequence caches for something only one cache has (its offset, say)."""


class Segments:
    """One layer's caches of a pass's sequences, and their rows (in order): what the model hands that layer's mixers
    in a pass of several sequences. A body that asks it for a mask gets each mixer's sequences their own."""

    def __init__(self, caches: list, lengths: List[int]):
        self.caches, self.lengths = caches, lengths

    def make_mask(self, n: int, **kwargs):
        return _SegmentMask(kwargs)

    def __getattr__(self, name):
        raise NotSegmentable(f"the model asks a pass's caches for {name!r}, which each sequence has its own of")


class _SegmentMask:
    """The mask of a pass of several sequences: each mixer makes each sequence's own, with the body's arguments."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs


_SEGMENTED = {}


def _segmented_class(cls):
    """A subclass of mixer class `cls` whose call, given Segments as its cache, runs for each sequence with that
    sequence's cache and mask: once over the sequences of each length where it stacks (`_call_stacked`), else once per
    sequence on its rows; the outputs laid end to end as the rows came."""
    if cls in _SEGMENTED:
        return _SEGMENTED[cls]
    signature = inspect.signature(cls.__call__)
    attends = _hook_attention(cls)

    def __call__(self, *args, **kwargs):
        if not any(isinstance(a, Segments) for a in args) and not isinstance(kwargs.get("cache"), Segments):
            return cls.__call__(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        x_name = list(bound.arguments)[1]
        segments, x, mask = bound.arguments["cache"], bound.arguments[x_name], bound.arguments.get("mask")
        kw = mask.kwargs if isinstance(mask, _SegmentMask) else None
        if mask is not None and kw is None:
            raise NotSegmentable("the model made one mask for a pass of several sequences")

        def call(rows, cache, mask):
            bound.arguments[x_name], bound.arguments["cache"] = rows, cache
            if "mask" in bound.arguments:
                bound.arguments["mask"] = mask
            return cls.__call__(*bound.args, **bound.kwargs)

        def mask_of(c, m):
            return c.make_mask(m, **kw) if kw is not None and c is not None and "mask" in bound.arguments else None

        lengths, caches = segments.lengths, segments.caches
        starts = np.cumsum([0] + lengths[:-1]).tolist()
        outs = [None] * len(lengths)
        for m in sorted(set(lengths)) if attends and _may_stack(self, caches) else []:
            seqs = [i for i, n in enumerate(lengths) if n == m]
            if len(seqs) == len(lengths):  # (every sequence: their rows stacked as they come)
                y = _call_stacked(self, call, x.reshape(len(seqs), m, -1), [mask_of(c, m) for c in caches], caches)
                if y is not None:
                    return y.reshape(1, -1, y.shape[-1])
            elif len(seqs) > 1:
                rows = mx.concatenate([x[:, starts[i] : starts[i] + m] for i in seqs])
                y = _call_stacked(self, call, rows, [mask_of(caches[i], m) for i in seqs], [caches[i] for i in seqs])
                for j, i in enumerate(seqs if y is not None else []):
                    outs[i] = y[j : j + 1]
        with row_rules.segmented(None):  # (inside, one sequence's rows)
            for i, (c, m) in enumerate(zip(caches, lengths)):
                if outs[i] is None:
                    outs[i] = call(x[:, starts[i] : starts[i] + m], c, mask_of(c, m))
        return mx.concatenate(outs, axis=1)

    _SEGMENTED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _SEGMENTED[cls]


# -- a mixer's call over several sequences at once --------------------------------------------------------------

_SDPA, _mlx_lm_attention = "scaled_dot_product_attention", mlx_lm_base.scaled_dot_product_attention


def _attention(queries, keys, values, cache, *args, **kwargs):
    """mlx-lm's scaled_dot_product_attention, as the mixers of a segmented class call it: a stacked call's is each
    sequence's own (`_StackedCaches.attention`)."""
    if isinstance(cache, _StackedCaches):
        return cache.attention(queries, keys, values, *args, **kwargs)
    return _mlx_lm_attention(queries, keys, values, cache, *args, **kwargs)


def _hook_attention(cls) -> bool:
    """Whether mixer class `cls` attends through mlx-lm's scaled_dot_product_attention, which its module then calls
    as `_attention` (mlx-lm's for every call but a stacked one)."""
    names = getattr(cls.__call__, "__globals__", {})
    if names.get(_SDPA) is _mlx_lm_attention:
        names[_SDPA] = _attention
    return names.get(_SDPA) is _attention


class _NotStacked(Exception):
    """A mixer asked a stacked call's caches for what each sequence has its own of."""


class _StackedCaches:
    """The caches of sequences whose mixer runs once over their rows stacked [k, m, d]. Their offsets are one vector
    (mx.fast.rope takes one a batch row, as for mlx-lm's batched caches); the keys and values the mixer stores go,
    when it attends to them, into each sequence's cache and attention alone. A mixer that asks its cache for anything
    else, or attends to other keys, raises _NotStacked before a cache is written."""

    def __init__(self, caches: list, mask):
        self.caches, self.mask = caches, mask
        self.offset = mx.array([c.offset for c in caches])
        self.new = None  # (keys, values) the mixer stored
        self.written = False

    def update_and_fetch(self, keys, values):
        if self.new is not None:
            raise _NotStacked("the mixer stores twice")
        self.new = (keys, values)
        return keys, values

    def attention(self, queries, keys, values, scale, mask, **kwargs):
        same_mask = mask is self.mask or (isinstance(mask, str) and mask == self.mask)
        if self.written or self.new is None or keys is not self.new[0] or values is not self.new[1] or not same_mask:
            raise _NotStacked("the mixer attends to other keys than it stored")
        self.written = True
        outs = []
        for i, c in enumerate(self.caches):
            k, v = c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            outs.append(_mlx_lm_attention(queries[i : i + 1], k, v, c, scale, mask, **kwargs))
        return mx.concatenate(outs, axis=0)

    def __getattr__(self, name):
        raise _NotStacked(f"the mixer asks its cache for {name!r}")


def _may_stack(mixer, caches) -> bool:
    """Whether a mixer may run once over several sequences: each its own cache, and the mixer's products quantised
    linear layers, whose rows compute as each alone where compute.rows.independent says so (there, on the CPU, so do
    RoPE's at a vector of offsets: tests/test_forward.py)."""
    if not row_rules.independent(True) or any(c is None for c in caches) or len(set(map(id, caches))) < len(caches):
        return False  # (one cache several times: a verification pass's positions, in turn)
    return all(
        isinstance(m, nn.QuantizedLinear) or all(v.ndim < 2 for v in m.values() if isinstance(v, mx.array))
        for _, m in mixer.named_modules()
    )


def _call_stacked(mixer, call, rows, masks: list, caches: list) -> Optional[mx.array]:
    """`call` (the mixer's) of sequences' rows stacked [k, m, d], their masks and caches, in one: [k, m, d], each
    sequence's rows what its call alone gives; None where it does not stack (the caches untouched). The first at each
    m runs on copies of the caches and is checked against the sequences' calls alone, which it returns."""
    m = rows.shape[1]
    same = all(a is None for a in masks) or all(isinstance(a, str) and a == masks[0] for a in masks)
    verdicts = vars(mixer).setdefault("_stacked", {})  # m -> whether its calls at m stack (absent: not checked yet)
    if not same or verdicts.get(m, True) is False:
        return None
    first, stacked = m not in verdicts, None
    try:
        stacked = _StackedCaches([copy.deepcopy(c) for c in caches] if first else caches, masks[0])
        with row_rules.segmented([m] * len(caches)):
            y = call(rows, stacked, masks[0])
        if not stacked.written:
            raise _NotStacked("the mixer did not attend through mlx-lm's attention")
    except Exception:
        if stacked is not None and stacked.written and not first:
            raise  # (the caches hold the keys: no call again)
        verdicts[m] = False
        return None
    if first:
        with row_rules.segmented(None):
            alone = mx.concatenate([call(rows[j : j + 1], c, a) for j, (c, a) in enumerate(zip(caches, masks))])
        verdicts[m] = bool(mx.array_equal(y, alone))
        return alone
    return y


def _takes_cache(module) -> bool:
    """Whether a module is a mixer: its call takes the layer's cache (or it is one made per-sequence already)."""
    if type(module) in _SEGMENTED.values():
        return True
    try:
        return "cache" in inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False


def _layer_children(model):
    """Each layer's direct children (the members of a list among them one by one)."""
    for layer in model.layers:
        for child in layer.children().values():
            yield from child if isinstance(child, list) else [child]


def segment_mixers(model) -> None:
    """Each layer's mixers (the modules it hands its cache: attention of any kind, SSM, convolution; inside a
    streamed wrapper, the module it holds) run per sequence in a pass of several (in place: the same parameters)."""
    for m in _layer_children(model):
        m = m.inner if isinstance(m, Streamed) else m
        if isinstance(m, nn.Module) and _takes_cache(m) and type(m) not in _SEGMENTED.values():
            m.__class__ = _segmented_class(type(m))


_PER_SEQUENCE = {}


def _per_sequence_class(cls):
    """A subclass of product class `cls` (a linear layer) whose rows run per sequence in a pass of several where its
    rows depend on each other (compute.rows.independent)."""
    if cls in _PER_SEQUENCE:
        return _PER_SEQUENCE[cls]

    def __call__(self, x):
        lengths = row_rules.segments()
        if lengths is None or row_rules.independent(isinstance(self, nn.QuantizedLinear)):
            return cls.__call__(self, x)
        return row_rules.per_segment(x, lengths, lambda part: cls.__call__(self, part))

    _PER_SEQUENCE[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _PER_SEQUENCE[cls]


def per_sequence(model) -> None:
    """The linear layers outside the mixers (routers, shared experts, the head) compute per sequence where their
    rows depend on each other (in place)."""
    mixers = set()
    for m in _layer_children(model):
        if isinstance(m, nn.Module) and (_takes_cache(m) or isinstance(m, Streamed)):
            mixers.update(id(sub) for _, sub in m.named_modules())
    for _, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and id(m) not in mixers:
            if type(m) not in _PER_SEQUENCE.values():
                m.__class__ = _per_sequence_class(type(m))


def body_of(model):
    """The module holding the embedding, the layers and the final norm (`model.model`; a multimodal wrapper's
    language model's)."""
    owner = model.get("language_model", model) if isinstance(model, nn.Module) else model
    return owner.get("model") if isinstance(owner, nn.Module) else None


class _Positions:
    """A model body returning only rows `positions` of its output: the head then computes those alone (a prompt's
    other logits are unused, and [positions, vocab] floats need not fit a budget)."""

    def __init__(self, inner, positions):
        self.inner, self.positions = inner, positions

    def __call__(self, *args, **kwargs):
        h = self.inner(*args, **kwargs)
        return h[:, self.positions]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextmanager
def head_on(model, positions):
    """The head applied to rows `positions` of the pass only (None: every row)."""
    owner = model.get("language_model", model) if positions is not None else None
    inner = owner.get("model") if owner is not None else None
    if inner is None:
        yield
        return
    owner.model = _Positions(inner, positions)
    try:
        yield
    finally:
        owner.model = inner


class _StageEmbedding(nn.Module):
    """A stage's embedding in its pass: the rows the stage before sent (`rows`), or the module's lookup; as the head
    (a tied embedding) the module's, or (a stage before the last) the rows as they are."""

    def __init__(self, module, rows, head: bool):
        super().__init__()
        self._module, self._rows, self._head = module, rows, head

    def __call__(self, ids):
        return self._module(ids) if self._rows is None else self._rows

    def as_linear(self, x):
        return self._module.as_linear(x) if self._head else x


def _ids(tokens) -> mx.array:
    return mx.array(np.asarray(tokens, dtype=np.int32).reshape(1, -1))


class MLXForward(Forward):
    """The pass through mlx-lm's own modules (module doc)."""

    name = "mlx"

    def __init__(self, model, dtype=mx.float32, why: Optional[str] = None):
        """dtype: the activations' (the rows a stage receives become it)."""
        self.model, self.dtype, self.why = model, dtype, why
        segment_mixers(model)
        per_sequence(model)
        self.body = body_of(model)
        self.segmentable = True  # False once a body turned out to need one cache (its passes then go one by one)
        self._checked_stage = False

    @property
    def engine(self):
        return getattr(self.model, "flash", None)

    def _touch(self, prompt: bool):
        if self.engine is not None:
            self.engine.stats.touch(prefill=prompt)

    def _pass(self, ids: mx.array, cache, prompt: bool, positions=None) -> mx.array:
        """The model on token ids [1, m] into `cache` (a layer's, or Segments), its head on rows `positions`."""
        self._touch(prompt)
        with head_on(self.model, positions):
            return self.model(ids, cache=cache)

    def __call__(self, tokens, cache, prompt: bool = False) -> mx.array:
        """Logits [1, m, vocab] of `tokens` (a prompt: [1, 1, vocab] of its last one); the caches advance by m. The
        positions of a pass that is not a prompt (a speculative verification) each compute as a decode step of it
        alone: one row each through the mixers, in turn (the units read once for all)."""
        ids = _ids(tokens)
        m = ids.shape[1]
        if prompt or m == 1 or not self.segmentable:
            return self._pass(ids, cache, prompt, [-1] if prompt and m > 1 else None)
        token = EVERY_ROW.set(True)  # (every position's logits: a streamed head in its chunks)
        try:
            with row_rules.segmented([1] * m):
                return self._pass(ids, [Segments([c] * m, [1] * m) for c in cache], prompt)
        finally:
            EVERY_ROW.reset(token)

    def run(self, seqs: Sequence[Tuple[List[int], list]], prompt: bool = False) -> np.ndarray:
        """Logits [len(seqs), vocab] of each sequence's last token, every sequence (its token ids, its cache in each
        layer) at its own position in one pass: the units read once for all, each sequence's logits and keys what a
        pass of it alone gives. The caches advance by each sequence's tokens."""
        if len(seqs) == 1 or not self.segmentable:
            outs = [self._pass(_ids(t), c, prompt, [-1] if len(t) > 1 else None)[0, -1] for t, c in seqs]
            return np.array(mx.stack(outs).astype(mx.float32))
        lengths = [len(ids) for ids, _ in seqs]
        ids = _ids(np.concatenate([np.asarray(t, dtype=np.int32) for t, _ in seqs]))
        caches = [Segments(list(layer), lengths) for layer in zip(*(c for _, c in seqs))]
        offsets = [cs[0].offset for _, cs in seqs]
        token = EVERY_ROW.set(True)  # (each sequence's logits: a streamed head in its chunks, not read whole)
        try:
            with row_rules.segmented(lengths):
                out = self._pass(ids, caches, prompt, mx.array(np.cumsum(lengths) - 1, dtype=mx.int32))
                mx.eval(out)
        except NotSegmentable:
            if [cs[0].offset for _, cs in seqs] != offsets:
                raise  # (caches moved before the body asked: nothing to go back to)
            self.segmentable = False  # this architecture's passes go one sequence at a time
            return self.run(seqs, prompt)
        finally:
            EVERY_ROW.reset(token)
        return np.array(out[0].astype(mx.float32))

    # -- a pipeline stage -------------------------------------------------------------------------------------------
    def stage(self, x, cache, prompt: bool = False):
        """This stage's share of a pass of one sequence: x token ids (the stage holding the embedding) or float32 rows
        [m, hidden] from the stage before; returns the rows after its layers (float32 numpy), or on the stage
        holding the head its logits [1, m, vocab] (a prompt: of its last row)."""
        if not self._checked_stage:
            self.check_stage()
        last = not isinstance(self.body.norm, Absent)
        rows = None if isinstance(x, list) else mx.array(x).astype(self.dtype)[None]
        real = self.body.embed_tokens
        self.body.embed_tokens = _StageEmbedding(real, rows, head=last)
        try:
            ids = _ids(x if rows is None else np.zeros(len(x)))
            out = self._pass(ids, cache, prompt, [-1] if last and prompt and len(x) > 1 else None)
        finally:
            self.body.embed_tokens = real
        if last:
            mx.eval(out)
            return out
        return np.array(out[0].astype(mx.float32))

    def check_stage(self):
        """That this model's body can run as a stage: the rows given as its embedding reach its first layer as they
        are, and (a stage before the last) leave its last layer to the output as they are. Raises ValueError
        naming what it does in between (e.g. gemma's scaled embedding, a logit soft cap)."""
        body, d = self.body, self.model.args.hidden_size
        want = np.arange(2 * d, dtype=np.float32).reshape(1, 2, d) / d
        probe = mx.array(want).astype(self.dtype)  # (a body may scale its embedding in place: compare with `want`)
        want = np.array(probe.astype(mx.float32))
        seen, layers = [], body.layers
        real = body.embed_tokens
        last = not isinstance(body.norm, Absent)

        class Capture:  # a layer that records its input and gives probe * 2 (the others pass it on)
            def __init__(self, layer):
                self.layer = layer

            def __getattr__(self, name):  # (what the body asks its layers: a sliding window, say)
                return getattr(self.layer, name)

            def __call__(self, x, *args, **kwargs):
                seen.append(np.array(x.astype(mx.float32)))
                return mx.array(2 * want).astype(x.dtype) if len(seen) == 1 else x

        body.layers = [Capture(layer) for layer in layers]
        body.embed_tokens = _StageEmbedding(real, probe, head=last)
        try:
            out = self.model(mx.zeros((1, 2), dtype=mx.int32), cache=None)
        except Exception as e:
            raise ValueError(f"its body does not run with its layers replaced ({type(e).__name__}: {e})") from None
        finally:
            body.layers, body.embed_tokens = layers, real
        if not seen or not np.array_equal(seen[0], want):
            raise ValueError("its body changes the embedding's rows before its first layer")
        if not last and not np.array_equal(np.array(out.astype(mx.float32)), 2 * want):
            raise ValueError("its body or head changes the rows after its last layer")
        self._checked_stage = True


class Auto(Forward):
    """The native step beneath the interface where it applies (decode steps, verification passes, short prompts and
    every batched pass), MLX's forward for the rest (long prompts)."""

    native = True

    def __init__(self, host, mlx: MLXForward):
        """host: the native step (native_step.HostDecoder)."""
        self.host, self.mlx = host, mlx
        self.name = "native, with MLX's for the passes it does not take"
        self.rows_alone = self.sequences_alone = host.rows_alone

    def __call__(self, tokens, cache, prompt: bool = False) -> mx.array:
        impl = self.host if self.host.applies(tokens, cache) else self.mlx
        return impl(tokens, cache, prompt)

    def run(self, seqs, prompt: bool = False) -> np.ndarray:
        return self.host.run(seqs, prompt)

    def stage(self, x, cache, prompt: bool = False):
        return self.host.stage(x, cache, prompt)

    def __getattr__(self, name):
        return getattr(self.host, name)
