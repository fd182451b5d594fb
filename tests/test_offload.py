"""Below the resident floor: attention layers, embeddings and the LM head streamed from flash.

Streamed models must generate exactly the tokens of the resident model, read exactly the
streamed weights' bytes per token, stay within the budget, and the planner must keep what fits."""

import os

from mlx_flash import BudgetError, FlashFormatError
from mlx_flash.budget import min_budget, min_streaming_budget, plan_memory
from mlx_flash.convert import convert
from mlx_flash.engine import resident
from mlx_flash.engine.resident import _spread, stream_groups
from mlx_flash.format.directory import RESIDENT, FlashDir
from mlx_flash.loader import cpu_cast, kv_size_of, load, load_resident
from mlx_flash.models.inspect import instantiate
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

PROMPT = [1, 5, 9, 33, 7, 100, 3]
CONTEXT = 64
CAST = cpu_cast  # the CPU path's resident dtypes


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """6-layer tiny models: llama (untied head), opt (tied, position embedding), qwen3 (q/k norms), gemma3 (tied)."""
    root = tmp_path_factory.mktemp("offload")
    return {
        arch: convert(
            str(make_tiny_model_dir(arch, root / f"src-{arch}", num_hidden_layers=6)),
            root / arch,
            alignment=512,
            progress=False,
        )
        for arch in ("llama", "opt", "qwen3", "gemma3_text")
    }


def floors(path):
    fd = FlashDir(path)
    groups = stream_groups(fd, instantiate(fd.config), CAST, CONTEXT)
    resident = fd.resident_nbytes(CAST)
    return (
        fd,
        groups,
        min_streaming_budget(fd, CONTEXT, kv_size_of(fd), resident=resident, groups=groups),
        min_budget(fd, CONTEXT, kv_size_of(fd), resident=resident),
    )


def greedy_logits(model, tokens):
    return np.array(model.forward(tokens, model.make_cache(), True)[0, -1])


def greedy(model, n):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("arch", ["llama", "opt", "qwen3", "gemma3_text"])
def test_streamed_model_equals_resident(dirs, arch):
    path = dirs[arch]
    fd, groups, floor, resident_floor = floors(path)
    assert floor < resident_floor
    ref, _ = load_resident(path)
    expected = greedy(ref, 24)
    budget = floor  # everything streamed, no FFN unit cached
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model, _ = load(path, memory_budget=budget, sparsity="dense", context=CONTEXT)
    try:
        plan = model.flash.plan
        assert plan.streamed == groups
        assert greedy(model, 24) == expected
        assert mx.get_peak_memory() - base <= budget
        # every decode token reads each streamed layer and head once, and one row of each embedding
        index = fd.resident_index()
        per_token = sum(
            (index[n].nbytes if g.kind != "rows" else 0)
            + (index[n].nbytes // index[n].shape[0] if "embed" in g.path else 0)
            for g in plan.streamed
            for n in g.tensors
        )
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()
        assert [t.streamed_bytes for t in toks[2:-2]] == [per_token] * len(toks[4:])
        assert all(t.bytes_requested >= t.streamed_bytes for t in toks)
        assert model.flash.streamer.reader.stats()["bytes_read"] >= sum(
            t.streamed_bytes for t in model.flash.stats.tokens
        )
    finally:
        model.flash.close()


def test_planner_streams_cheapest_first_and_keeps_what_fits(dirs):
    path = dirs["llama"]
    fd, groups, floor, resident_floor = floors(path)
    kinds = [g.kind for g in groups]
    assert kinds == sorted(kinds, key=["rows", "layer", "head"].index)  # rows, then layers, then the head
    layers = [g for g in groups if g.kind == "layer"]
    resident = fd.resident_nbytes(CAST)
    plan = plan_memory(fd, resident_floor, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)
    assert plan.streamed == []  # everything fits: nothing streamed
    plan = plan_memory(fd, floor, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)
    assert plan.streamed == groups and sum(c["neurons"] for c in plan.capacity) == 0
    mid = plan_memory(fd, (floor + resident_floor) // 2, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)
    streamed_layers = [g for g in mid.streamed if g.kind == "layer"]
    assert 0 < len(streamed_layers) < len(layers)  # some attention layers stay resident
    assert mid.resident + mid.kv_cache + mid.scratch + mid.workspace + mid.streaming <= mid.budget
    assert "attention layers" in mid.describe({"neurons": 1}, {"neurons": 1})
    with pytest.raises(BudgetError, match="too small even with attention, embeddings and LM head streamed"):
        plan_memory(fd, floor - 1, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)


def test_a_large_input_embedding_is_streamed_by_rows_whenever_units_go_uncached(tmp_path):
    """An untied embedding read a row per token frees its bytes for FFN units: the planner streams it as
    soon as the budget cannot cache every unit, though the resident weights fit, and the tokens stay."""
    src = make_tiny_model_dir(
        "llama", tmp_path / "src", num_hidden_layers=3, vocab_size=4096, tie_word_embeddings=False
    )
    path = convert(str(src), tmp_path / "flash", alignment=512, progress=False)
    fd, groups, _, resident_floor = floors(path)
    rows = [g for g in groups if g.kind == "rows"]
    assert len(rows) == 1 and rows[0].nbytes > 2 * rows[0].load_bytes
    resident = fd.resident_nbytes(CAST)
    budget = resident_floor + fd.ffn_bytes // 2
    plan = plan_memory(fd, budget, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)
    assert plan.streamed == rows
    everything = plan_memory(
        fd, resident_floor + 2 * fd.ffn_bytes, CONTEXT, kv_size_of(fd), resident=resident, groups=groups
    )
    assert everything.streamed == []
    assert sum(c["neurons"] for c in plan.capacity) > sum(
        c["neurons"] for c in plan_memory(fd, budget, CONTEXT, kv_size_of(fd), resident=resident).capacity
    )  # groups=(): resident
    ref, _ = load_resident(path)
    model, _ = load(path, memory_budget=budget, sparsity="dense", context=CONTEXT)
    try:
        assert model.flash.plan.streamed == rows
        assert greedy(model, 16) == greedy(ref, 16)
    finally:
        model.flash.close()


def test_below_the_resident_floor_two_whole_layers_are_read_ahead_first(dirs):
    """Dense read-ahead of whole layers takes precedence over resident attention layers (more are streamed),
    the plan stays inside the budget and the tokens stay the resident model's."""
    path = dirs["llama"]
    fd, groups, floor, resident_floor = floors(path)
    resident = fd.resident_nbytes(CAST)
    n, stride = fd.layers[0]["neurons"].n_units, fd.layouts["neurons"].stride
    budget = (floor + resident_floor) // 2 + 2 * n * stride
    plain = plan_memory(fd, budget, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)
    ahead = plan_memory(fd, budget, CONTEXT, kv_size_of(fd), resident=resident, groups=groups, prefetch=True)
    layers = [len([g for g in p.streamed if g.kind == "layer"]) for p in (plain, ahead)]
    assert ahead.prefetch_rows + ahead.capacity[0]["neurons"] == n and layers[1] > layers[0]  # all uncached read ahead
    assert plain.prefetch_rows == 0
    used = ahead.resident + ahead.kv_cache + ahead.scratch + ahead.workspace + ahead.streaming
    assert used + ahead.cache_bytes({"neurons": stride}) + 2 * ahead.prefetch_rows * stride <= budget
    ref, _ = load_resident(path)
    model, _ = load(path, memory_budget=budget, sparsity="dense", context=CONTEXT)
    try:
        assert model.flash.plan.prefetch_rows == ahead.prefetch_rows
        assert greedy(model, 16) == greedy(ref, 16)
    finally:
        model.flash.close()


def test_spread_order():
    assert sorted(_spread(6)) == list(range(6))
    assert _spread(8)[:2] == [0, 4] and sorted(_spread(8)[:4]) == [0, 2, 4, 6]  # prefixes are evenly spread


def test_budget_below_the_streaming_floor(dirs):
    path = dirs["opt"]
    _, _, floor, _ = floors(path)
    with pytest.raises(BudgetError, match="too small"):
        load(path, memory_budget=floor - 1, context=CONTEXT)


def open_files() -> int:
    """This process's open file descriptors (/proc on Linux, /dev/fd on macOS)."""
    return len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))


def test_close_releases_the_stream_reader(dirs):
    path = dirs["qwen3"]
    _, _, floor, _ = floors(path)
    fds = open_files()
    model, _ = load(path, memory_budget=floor, sparsity="dense", context=CONTEXT)
    greedy(model, 2)
    assert model.flash.streamer is not None
    model.flash.close()
    assert open_files() == fds


def test_corrupt_resident_header_is_a_format_error(dirs, tmp_path):
    import shutil

    path = shutil.copytree(dirs["llama"], tmp_path / "copy")
    with open(path / RESIDENT, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))  # a header length past the end of the file
    with pytest.raises(FlashFormatError, match="checksum mismatch"):
        load(path, memory_budget="50%", context=CONTEXT)
    # the header is parsed safely too, whatever its checksum says
    with pytest.raises(FlashFormatError, match="unreadable safetensors header"):
        FlashDir(path).resident_index()


def test_prompt_logits_stay_lazy_and_equal_resident(dirs, float_activations):
    """A prompt's logits (mlx-lm discards all but the last token's) cost no head reads until evaluated,
    and evaluated they equal the resident model's."""
    from mlx_lm.models.cache import make_prompt_cache

    path = dirs["llama"]
    fd, groups, floor, _ = floors(path)
    ref, _ = load_resident(path)
    expected = ref(mx.array(PROMPT)[None], cache=make_prompt_cache(ref))
    model, _ = load(path, memory_budget=floor, sparsity="dense", context=CONTEXT)
    try:
        logits = model(mx.array(PROMPT)[None], cache=make_prompt_cache(model))
        index = fd.resident_index()
        layers = sum(index[n].nbytes for g in groups if g.kind == "layer" for n in g.tensors)
        rows = sum(index[n].nbytes // index[n].shape[0] for n in groups[0].tensors) * len(set(PROMPT))
        assert groups[0].path.endswith("embed_tokens") and groups[-1].path == "lm_head"
        assert model.flash.stats.current.streamed_bytes == layers + rows  # the LM head was not read
        assert mx.allclose(logits, expected, atol=1e-4, rtol=1e-4).item()
    finally:
        model.flash.close()


def test_attach_moves_the_streamer(dirs):
    """A model with streamed attention keeps working on another engine: its streamer (and the
    streamed bytes in the stats) move to the new engine, and closing the old one does not close it."""
    from mlx_flash.engine.neurons import NeuronEngine
    from mlx_flash.engine.sparsity import Dense

    path = dirs["llama"]
    fd, _, floor, _ = floors(path)
    expected = greedy(load_resident(path)[0], 8)
    model, _ = load(path, memory_budget=floor, sparsity="dense", context=CONTEXT)
    first = model.flash
    streamer = first.streamer
    second = NeuronEngine(fd, first.reader, Dense(fd.ffn["intermediate_size"]), first.plan.capacity, first.plan.scratch)
    second.plan = first.plan
    try:
        assert second.attach(model) is first
        assert second.streamer is streamer and first.streamer is None and streamer.stats is second.stats
        assert greedy(model, 8) == expected
        second.stats.end()
        assert all(t.streamed_bytes > 0 for t in second.stats.decode_tokens())
    finally:
        second.close()


def test_streamed_modules_add_no_host_synchronisation_on_the_mlx_path(dirs, monkeypatch, mlx_ops):
    """On MLX's forward (a Mac's GPU), a streamed attention layer or head chunk is queued, not waited for: its buffer's
    next read waits for it instead (Stats.waits), by when a later chunk is queued or a layer's FFN has synchronised.
    A decode token then synchronises at most once a layer, with the resident model's tokens."""
    monkeypatch.setattr(resident, "HEAD_CHUNK_BYTES", 8 << 10)  # a head of several chunks
    path = dirs["llama"]
    fd, groups, floor, _ = floors(path)
    expected = greedy(load_resident(path)[0], 12)
    model, _ = load(path, memory_budget=floor, sparsity="dense", context=CONTEXT, backend="mlx")
    try:
        assert {g.kind for g in model.flash.plan.streamed} == {"rows", "layer", "head"}
        assert greedy(model, 12) == expected
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()
        head = len(model.flash.streamer.chunks("lm_head"))
        assert head > 2
        assert all(t.syncs <= len(fd.layers) for t in toks)
        assert all(t.waits >= head for t in toks[1:])
        # a batched pass (the server's) uses every row's logits: the head streams in its chunks, not read whole
        caches = [model.make_cache() for _ in range(3)]
        for i, c in enumerate(caches):
            model.forward([t + i for t in PROMPT], c, True)
        model.flash.streamer.lazy = None
        model.flash.stats.begin_token()
        together = model.forward.run([(PROMPT[:2], c) for c in caches])
        assert model.flash.stats.current.waits >= head
        assert np.allclose(together[0], greedy_logits(model, PROMPT + PROMPT[:2]), atol=1e-5)
    finally:
        model.flash.close()
