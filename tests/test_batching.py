"""Continuous batching: the forward's batched pass (native or MLX's) gives each sequence what a pass of it alone gives,
bit for bit, and a step of mlx-lm's BatchGenerator is one pass with the prompts beside (the server's batches:
test_server_batching.py)."""

import copy

from mlx_flash.budget import min_budget
from mlx_flash.engine import batching
from mlx_flash.engine.batching import BatchModel, FlashBatchGenerator
from mlx_flash.engine.forward import FloatKVCache, HalfKVCache, SequenceBatch
from mlx_flash.engine.native_step import HostKVCache
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

CONTEXT = 192


def _solo(model, prompt, steps):
    """Logits of a prompt's last token, then of `steps` greedy decode steps, the sequence alone."""
    cache = model.make_cache()
    out = [np.array(model.forward(prompt, cache, prompt=True))[0, -1]]
    for _ in range(steps):
        out.append(np.array(model.forward([int(out[-1].argmax())], cache))[0, -1])
    return out


def _batched(model, prompts, steps):
    """The same, the prompts prefilled together right-padded (as mlx-lm's BatchGenerator does) and decoded together."""
    cache = [type(layer[0]).merge(list(layer)) for layer in zip(*[model.make_cache() for _ in prompts])]
    n = max(len(p) for p in prompts)
    for c in cache:
        c.prepare(lengths=[len(p) for p in prompts], right_padding=[n - len(p) for p in prompts])
    padded = mx.array([p + [0] * (n - len(p)) for p in prompts])
    out = [[row] for row in np.array(model.forward.batch(padded, cache))[:, 0]]
    for c in cache:
        c.finalize()
    for _ in range(steps):
        tokens = mx.array([[int(o[-1].argmax())] for o in out])
        for o, row in zip(out, np.array(model.forward.batch(tokens, cache))[:, 0]):
            o.append(row)
    return out


@pytest.mark.parametrize("which", ["smol", "tiny_qwen3_moe"])
def test_a_batched_pass_is_each_sequence_alone(which, request):
    """Prompts of different lengths, prefilled and decoded together: each sequence's logits are its solo logits, bit
    for bit, and the batch reads its units once (fewer bytes than the sequences alone)."""
    path = request.getfixturevalue(which)
    fd = FlashDir(path)
    # SmolLM2: most units streamed; the MoE: two expert slots a layer
    budget = (
        "60%"
        if which == "smol"
        else min_budget(fd, 64, kv_size_of(fd)) + 2 * len(fd.layers) * fd.layouts["experts"].stride
    )
    model, _ = load(path, memory_budget=budget, context=64)
    try:
        assert all(isinstance(c, SequenceBatch) for c in _batch_caches(model, 2)), model.forward.name
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41], [7, 250, 12, 99, 5], [255, 3, 80, 17, 23, 9, 11]]
        stats = model.flash.stats
        before = stats.device_bytes()
        solo = [_solo(model, p, 6) for p in prompts]
        alone = stats.device_bytes() - before
        before = stats.device_bytes()
        together = _batched(model, prompts, 6)
        batched = stats.device_bytes() - before
    finally:
        model.flash.close()
    for s, t in zip(solo, together):
        assert len(s) == len(t) and all(np.array_equal(a, b) for a, b in zip(s, t))
    # dense: every streamed unit once for all; MoE: the union of the sequences' experts (of 8, 2 cached)
    assert batched < (0.6 if which == "smol" else 0.95) * alone


def _batch_caches(model, n):
    return [type(layer[0]).merge(list(layer)) for layer in zip(*[model.make_cache() for _ in range(n)])]


def test_batch_caches_join_leave_and_are_stored_apart():
    a, b, c = HostKVCache(16), HostKVCache(16), HostKVCache(16)
    for i, x in enumerate((a, b, c)):
        x.reserve(4, 2, 8)
        x._k[:] = i
        x.offset = 4
    batch = HostKVCache.merge([a, b])
    assert isinstance(batch, SequenceBatch)
    batch.extend(HostKVCache.merge([c]))
    batch.filter([0, 2])
    assert batch.caches == [a, c] and batch.nbytes == a.nbytes + c.nbytes
    stored = batch.extract(1)  # handed out, not copied (a finishing sequence leaves without a copy) ...
    assert stored is c
    batch.own([1])  # ... until the batch writes there again
    batch.caches[1]._k[:] = 9
    assert stored.offset == 4 and np.all(np.array(stored.keys) == 2) and batch.caches[1].offset == 4
    assert copy.deepcopy(batch).caches[0] is a  # mlx-lm copies a batch to split it: no sequence's KV doubled
    batch.prepare(lengths=[3, 1], right_padding=[0, 2])
    assert batch.lengths(2) == [2, 1]
    batch.advance(2)
    assert batch.lengths(2) == [1, 0]
    with pytest.raises(ValueError, match="left-padded"):
        batch.prepare(left_padding=[0, 1])


@pytest.mark.parametrize("kind", [FloatKVCache, HalfKVCache])
def test_mlx_caches_handed_out_are_copied_before_the_batch_writes(kind):
    """MLX's caches in a batch: a sequence's cache handed to the prompt cache keeps what it held when the batch
    writes that sequence again (MLX arrays are written in place by slice assignment)."""
    a, b = kind(), kind()
    for i, c in enumerate((a, b)):
        c.update_and_fetch(*(mx.full((1, 2, 3, 8), float(i)),) * 2)
    batch = kind.merge([a, b])
    stored = batch.extract(0)
    batch.own([0])
    batch.caches[0].update_and_fetch(mx.full((1, 2, 1, 8), 9.0), mx.full((1, 2, 1, 8), 9.0))
    assert stored.offset == 3 and float(stored.keys[..., :3, :].max()) == 0.0 and batch.caches[0].offset == 4


def _generate_all(generator_class, model, prompts, max_tokens, step, late=()):
    """Greedy tokens of each prompt from mlx-lm's BatchGenerator (prompts prefilled one at a time, as the server's
    were) or the flash one, both over the model's forward, the prompts in `late` inserted after the others' third
    step, and the passes it ran (each one's tokens per sequence). Every pass of a prompt's chunk gives back what its
    buffers left (memory.give_back) before the next one."""
    passes, given = [], []
    forward = model.forward
    run = forward.run
    forward.run = lambda seqs, prompt=False: passes.append([len(t) for t, _ in seqs]) or run(seqs, prompt)
    give_back = batching.give_back
    batching.give_back = lambda: given.append(len(passes) - 1)
    try:
        gen = generator_class(
            BatchModel(model),
            completion_batch_size=4,
            prefill_batch_size=4 if generator_class is FlashBatchGenerator and model.forward.sequences_alone else 1,
            prefill_step_size=step,
        )
        first = [p for i, p in enumerate(prompts) if i not in late]
        uids = dict(zip(gen.insert(first, max_tokens=[max_tokens] * len(first)), first))
        out, steps = {}, 0
        while True:
            steps += 1
            if steps == 3 and late:
                later = [prompts[i] for i in late]
                uids.update(zip(gen.insert(later, max_tokens=[max_tokens] * len(later)), later))
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                out.setdefault(prompts.index(uids[r.uid]), []).append(r.token)
        gen.close()
    finally:
        forward.run, batching.give_back = run, give_back
    assert {i for i, lengths in enumerate(passes) if max(lengths) > 1} <= set(given)
    return [out[i] for i in range(len(prompts))], passes


_SOLO = {}  # model -> each prompt's solo greedy tokens (the same whatever the step or the late prompts)


@pytest.mark.parametrize("which, step", [("smol", 16), ("smol", 48), ("tiny_qwen3_moe", 16)])
@pytest.mark.parametrize("late", [(), (2, 3)])
def test_a_step_is_one_pass_with_the_prompts_beside(which, step, late, request):
    """FlashBatchGenerator: each step of mlx-lm's BatchGenerator is one pass (the generating sequences, the prompts
    joining them and prompt chunks in the positions left), each sequence's tokens its solo greedy ones, in fewer
    passes than mlx-lm's schedule (a pass for the decode step, one for a prompt chunk, one per joining prompt);
    prompts inserted while others decode join the running batch. Where a pass's rows are not each computed alone
    (the native step's MoE router), mlx-lm's schedule."""
    path = request.getfixturevalue(which)
    fd = FlashDir(path)
    # SmolLM2: most units streamed; the MoE: two expert slots a layer beside 4 sequences' KV caches
    budget = (
        "60%"
        if which == "smol"
        else min_budget(fd, 4 * CONTEXT, kv_size_of(fd)) + 2 * len(fd.layers) * fd.layouts["experts"].stride
    )
    model, _ = load(path, memory_budget=budget, context=CONTEXT, sequences=4)
    try:
        # two prompts of two 16-token chunks, two of one; all of one 48-token chunk
        prompts = [list(range(5, 29)), [40, 41] * 6, [7, 250, 12, 99, 5, 8, 9, 10, 11], list(range(200, 220))]
        if which not in _SOLO:
            _SOLO[which] = [[int(logits.argmax()) for logits in _solo(model, p, 5)] for p in prompts]
        solo = _SOLO[which]
        stock, stock_passes = _generate_all(BatchGenerator, model, prompts, 6, step, late)
        flash, passes = _generate_all(FlashBatchGenerator, model, prompts, 6, step, late)
    finally:
        model.flash.close()
    assert flash == solo and stock == solo
    if not model.forward.sequences_alone:
        assert passes == stock_passes
        return
    # within the pass's positions (a chunk cut as a request alone cuts it may come beside the 4 decoding sequences)
    assert all(sum(lengths) <= step + (0 if model.forward.rows_alone else 4) for lengths in passes)
    assert len(passes) < 0.75 * len(stock_passes), (len(passes), len(stock_passes))
