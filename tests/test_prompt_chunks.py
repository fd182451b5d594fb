"""Prompt chunks as large as a share of the model holds (budget.PROMPT_SHARE, Plan.prefill_step, Plan.prompt_loan,
Engine.lending): the same chunk at every budget whose unit caches (or read-ahead buffers) can lend what the workspace
does not hold, lent while the prompt runs and given back after it, and the same tokens and log-probabilities at
every budget."""

from mlx_flash import budget
from mlx_flash.budget import min_budget
from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import kv_size_of, load
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest

CONTEXT = 700
PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, 250, 600)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunks")
    # (4 layers: a dense plan's read-ahead buffers need more than 2)
    src = make_tiny_model_dir("llama", root / "src", vocab_size=257, intermediate_size=1024, num_hidden_layers=4)
    return convert(str(src), root / "flash", progress=False)


def share_of_next_chunk(fd, plan, native) -> float:
    """A PROMPT_SHARE whose chunk is the size after the workspace's (a tiny model's own share is under its workspace;
    the caches at the budgets below can lend the difference)."""
    step = plan.prefill_step(fd, CONTEXT, native, lend=False)
    after = min(s for k in range(4, 12) for s in (1 << k, 3 << (k - 1)) if s > step)
    return (
        after * budget.position_bytes(fd, CONTEXT, native) + budget.pass_bytes(fd, CONTEXT, native)
    ) / fd.model_bytes


def test_the_chunk_is_the_same_at_every_budget_and_the_caches_lend_the_rest(path, monkeypatch):
    fd = FlashDir(path)
    floor = min_budget(fd, CONTEXT, kv_size_of(fd))
    runs, lent, borrowed = [], [], []
    for extra in (fd.ffn_bytes // 3, fd.ffn_bytes * 2 // 3, 4 * fd.ffn_bytes):
        model, _ = load(path, memory_budget=floor + extra, sparsity="dense", context=CONTEXT)
        engine, native = model.flash, model.forward.native
        plan = engine.plan
        if not runs:
            monkeypatch.setattr(budget, "PROMPT_SHARE", share_of_next_chunk(fd, plan, native))
        step = plan.prefill_step(fd, CONTEXT, native)
        assert step > plan.prefill_step(fd, CONTEXT, native, lend=False)  # (the share, not the workspace)
        need = step * budget.position_bytes(fd, CONTEXT, native) + budget.pass_bytes(fd, CONTEXT, native)
        need -= plan.pass_room()  # (beyond the workspace's room for a pass: MLX's cache of freed buffers has the rest)
        room = plan.budget - plan.nbytes(fd.strides)  # (the largest budget caches every unit and has room left)
        loan = plan.prompt_loan(fd, CONTEXT, native)
        assert loan == max(0, need - room) <= plan.lendable(fd.strides)
        sizes, ahead, resize = [], [], engine.resize

        def resized(capacity, resize=resize, sizes=sizes):
            sizes.append(sum(c * fd.strides[r] for layer in capacity for r, c in layer.items()))
            ahead.append(engine.read_ahead is not None)
            resize(capacity)

        monkeypatch.setattr(engine, "resize", resized)
        out = list(generate_step(mx.array(PROMPT), model, max_tokens=4, prefill_step_size=step))
        # while the prompt ran, the plan's other parts, the caches and the passes' room within the budget (the
        # read-ahead buffers dropped where the caches alone could not lend it); after it, all as planned
        want, prefetch = plan.cache_bytes(fd.strides), plan.prefetch_bytes(fd.strides)
        if loan:
            dropped = loan > want
            assert len(sizes) == 2 and ahead[0] == (prefetch > 0 and not dropped)
            assert plan.nbytes(fd.strides) - want + sizes[0] - dropped * prefetch + need <= plan.budget
            assert sizes[1] == want
            borrowed.append(dropped)
        else:
            assert sizes == []
        assert (engine.read_ahead is not None) == (prefetch > 0)
        assert [sum(c for c in layer.values()) for layer in plan.capacity] == [
            sum(c.capacity for c in regions.values()) for regions in engine.caches
        ]
        lent.append(loan)
        runs.append((step, [t for t, _ in out], np.stack([np.array(lp) for _, lp in out])))
        engine.close()
    assert len({s for s, _, _ in runs}) == 1 and lent[0] > 0 and lent[-1] == 0
    assert borrowed == [True, False]  # (the read-ahead buffers lent at the least budget, the caches at the next)
    for _, tokens, logprobs in runs[1:]:
        assert tokens == runs[0][1] and np.array_equal(logprobs, runs[0][2])


def test_a_budget_whose_caches_cannot_lend_takes_the_workspace_s_chunk(path, monkeypatch):
    fd = FlashDir(path)
    model, _ = load(path, memory_budget=min_budget(fd, CONTEXT, kv_size_of(fd)), sparsity="dense", context=CONTEXT)
    try:
        plan, native = model.flash.plan, model.forward.native
        monkeypatch.setattr(budget, "PROMPT_SHARE", share_of_next_chunk(fd, plan, native))
        assert plan.prefill_step(fd, CONTEXT, native) == plan.prefill_step(fd, CONTEXT, native, lend=False)
        assert plan.prompt_loan(fd, CONTEXT, native) == 0
    finally:
        model.flash.close()


def test_a_resize_gives_a_cache_s_rows_back_before_it_takes_the_new_ones(path, monkeypatch):
    """Engine.resize (a prompt's loan and its return, an elastic budget) holds at most the larger of the caches before
    and after it: a layer's old rows go before its new ones are taken, or the two at once would hold that layer's cache
    beyond the plan."""
    import weakref

    from mlx_flash.engine import units
    from mlx_flash.engine.cache import UnitCache

    fd = FlashDir(path)
    floor = min_budget(fd, CONTEXT, kv_size_of(fd))
    model, _ = load(path, memory_budget=floor + fd.ffn_bytes // 2, sparsity="dense", context=CONTEXT)
    engine = model.flash
    live = weakref.WeakSet(c for regions in engine.caches for c in regions.values())
    held = []  # the caches' bytes alive as each new cache is made

    class Counted(UnitCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            live.add(self)
            held.append(sum(c.nbytes for c in live))

    monkeypatch.setattr(units, "UnitCache", Counted)
    try:
        plan = engine.plan
        for budget in (plan.nbytes(fd.strides) - plan.cache_bytes(fd.strides) // 2, plan.budget):  # lent, returned
            before, held[:] = sum(c.nbytes for c in live), []
            engine.resize(plan.resized(fd, budget).capacity)
            after = sum(c.nbytes for c in live)
            assert held and before != after and max(held) <= max(before, after)
    finally:
        engine.close()
