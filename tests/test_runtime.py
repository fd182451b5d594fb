"""The flash runtime: streamed FFNs equal the dense model, caches really evict, stats add up, budgets hold."""

from mlx_flash import BudgetError, FlashError
from mlx_flash.budget import min_budget, parse_size
from mlx_flash.compute.ffn import ACTIVATIONS, project
from mlx_flash.convert import convert
from mlx_flash.engine.sparsity import Oracle
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load, load_resident
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

PROMPT = [1, 5, 9, 33, 7, 100, 3]
CONTEXT = 256


@pytest.fixture(scope="module")
def flash_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    out = {}
    for arch, layout in (("llama", "neurons"), ("opt", "neurons"), ("phi3", "neurons"), ("llama", "dip")):
        src = make_tiny_model_dir(arch, root / f"src-{arch}")
        out[arch, layout] = convert(str(src), root / f"{arch}-{layout}", layout=layout, alignment=512, progress=False)
    return out


def small_budget(path, ffn_fraction=0.1, sparsity=None):
    """Resident + KV cache + scratch + `ffn_fraction` of the FFN (+ the oracle's own copy of gate/up):
    caches far smaller than the FFN."""
    fd = FlashDir(path)
    return (
        min_budget(fd, CONTEXT, kv_size_of(fd))
        + int(ffn_fraction * fd.ffn_bytes)
        + (Oracle(fd).nbytes if sparsity == "oracle" else 0)
    )


def greedy(model, n=64):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("arch", ["llama", "opt", "phi3"])
@pytest.mark.parametrize("sparsity", ["oracle", "dense"])
def test_streamed_tokens_equal_dense(flash_dirs, arch, sparsity):
    path = flash_dirs[arch, "neurons"]
    ref, fd = load_resident(path)
    model, _ = load(path, memory_budget=small_budget(path, sparsity=sparsity), sparsity=sparsity, context=CONTEXT)
    try:
        caps = model.flash.plan.capacity
        assert all(0 < c["neurons"] < fd.layers[0]["neurons"].n_units / 5 for c in caps)
        assert greedy(model) == greedy(ref)
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()
        assert len(toks) == 65  # mlx-lm computes one token ahead
        # eviction and reload really happened, and every byte read is a miss of one bundle
        stride = fd.layouts["neurons"].stride
        assert sum(t.misses for t in toks) > 0
        for t in toks:
            assert t.bytes_requested == t.misses * stride
        assert model.flash.reader.stats()["bytes_requested"] >= sum(t.bytes_requested for t in model.flash.stats.tokens)
    finally:
        model.flash.close()


def test_relu_oracle_reads_only_active_neurons(flash_dirs):
    path = flash_dirs["opt", "neurons"]
    model, _ = load(path, sparsity="oracle", context=CONTEXT)  # no budget: everything fits, nothing overflows
    try:
        greedy(model, 8)
        model.flash.stats.end()
        n = FlashDir(path).layers[0]["neurons"].n_units
        active = [a for t in model.flash.stats.decode_tokens() for a in t.active]
        assert 0 < np.mean(active) < n  # ReLU: only neurons with non-zero activation
    finally:
        model.flash.close()


def test_dip_full_density_equals_dense(flash_dirs):
    path = flash_dirs["llama", "dip"]
    ref, _ = load_resident(path)
    model, _ = load(path, memory_budget=small_budget(path), sparsity="dip", density=1.0, context=CONTEXT)
    try:
        assert greedy(model, 32) == greedy(ref, 32)
    finally:
        model.flash.close()


@pytest.mark.parametrize("sparsity", ["dense", "oracle"])
def test_dip_layout_serves_the_lossless_modes(flash_dirs, sparsity):
    """Dense and oracle on the dip layout: every input column and every (non-zero) neuron, read through
    the inputs / neurons regions; the oracle ranks the exact GLU the runtime computed (no copy)."""
    path = flash_dirs["llama", "dip"]
    ref, fd = load_resident(path)
    model, _ = load(path, memory_budget=small_budget(path), sparsity=sparsity, context=CONTEXT)
    try:
        assert model.flash.sparsifier.name == sparsity and model.flash.plan.extra == 0
        assert greedy(model, 32) == greedy(ref, 32)
        model.flash.stats.end()
        n = fd.layers[0]["inputs"].n_units + fd.layers[0]["neurons"].n_units
        assert all(a == n for t in model.flash.stats.decode_tokens() for a in t.active)
    finally:
        model.flash.close()


@pytest.mark.parametrize("gamma", [1.0, 0.2])
def test_dip_layer_matches_reference(flash_dirs, gamma):
    """One decode step of one layer against DIP computed from the dense weights (DIP eq. 8)."""
    path = flash_dirs["llama", "dip"]
    fd = FlashDir(path)
    model, _ = load(
        path, memory_budget=small_budget(path, 0.3), sparsity="dip", density=0.5, gamma=gamma, context=CONTEXT
    )
    engine = model.flash
    try:
        arrays = fd.unpack_layer(0)
        m = fd.ffn["matrices"]
        for step in range(6):
            x = mx.random.normal((1, 1, fd.ffn["hidden_size"]), key=mx.random.key(step))
            xv = np.array(x.reshape(-1))
            cached_in = engine.caches[0]["inputs"].cached_mask()
            cached_out = engine.caches[0]["neurons"].cached_mask()
            engine.stats.begin_token()
            y = engine.ffn(0, x, {})
            # reference from the full matrices, with the same cache state for DIP-CA
            w_in = np.abs(xv) * np.where(cached_in, 1.0, gamma)
            s_in = np.sort(np.argsort(-w_in, kind="stable")[: len(xv) // 2])
            xs = mx.zeros_like(x)
            xs[..., mx.array(s_in)] = x[..., mx.array(s_in)]
            h = ACTIVATIONS["silu"](project(xs, arrays, "gate", m["gate"])) * project(xs, arrays, "up", m["up"])
            hv = np.array(h.reshape(-1))
            w_out = np.abs(hv) * np.where(cached_out, 1.0, gamma)
            s_out = np.sort(np.argsort(-w_out, kind="stable")[: len(hv) // 2])
            hm = mx.zeros_like(h)
            hm[..., mx.array(s_out)] = h[..., mx.array(s_out)]
            ref = project(hm, arrays, "down", m["down"])
            assert mx.allclose(y, ref, atol=1e-4, rtol=1e-4).item(), step
    finally:
        engine.close()


def test_prefill_seeds_window(flash_dirs):
    path = flash_dirs["llama", "neurons"]
    model, _ = load(path, sparsity="dense", window=2, context=CONTEXT)
    try:
        model(mx.array([PROMPT]))
        n = FlashDir(path).layers[0]["neurons"].n_units
        assert all(c["neurons"].num_used == n for c in model.flash.caches)  # dense: every neuron seeded
        model.flash.stats.begin_token()
        greedy(model, 2)
        model.flash.stats.end()
        assert model.flash.stats.decode_tokens()[0].misses == 0  # the first decode step hits the seeded cache
    finally:
        model.flash.close()


def test_budget_too_small(flash_dirs):
    path = flash_dirs["llama", "neurons"]
    fd = FlashDir(path)
    with pytest.raises(BudgetError, match=r"too small.*resident weights .* need"):
        load(path, memory_budget=fd.resident_bytes // 2, context=CONTEXT)
    with pytest.raises(BudgetError):
        load(path, memory_budget="1KB", context=CONTEXT)


def test_peak_memory_within_budget(flash_dirs):
    path = flash_dirs["llama", "neurons"]
    budget = small_budget(path, 0.2, "oracle")
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model, _ = load(path, memory_budget=budget, sparsity="oracle", context=CONTEXT)
    try:
        greedy(model, 16)
        assert model.flash.plan.extra == model.flash.sparsifier.nbytes  # the oracle's copy is planned
        assert mx.get_peak_memory() - base <= budget
    finally:
        model.flash.close()


def test_bad_options(flash_dirs):
    with pytest.raises(FlashError, match="needs a flash directory converted with --layout dip"):
        load(flash_dirs["llama", "neurons"], sparsity="dip")
    with pytest.raises(FlashError, match="no predictors"):
        load(flash_dirs["llama", "neurons"], sparsity="predictor")
    with pytest.raises(FlashError, match="needs the neurons layout"):
        load(flash_dirs["llama", "dip"], sparsity="sketch")
    with pytest.raises(FlashError, match="unknown sparsity"):
        load(flash_dirs["llama", "neurons"], sparsity="magic")


def test_parse_size():
    assert parse_size("2GB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("50%", total=1000) == 500
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError):
        parse_size("lots")


def test_close_releases_files_and_threads(flash_dirs):
    import os
    import threading

    path = flash_dirs["llama", "neurons"]
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    result = {}
    t = threading.Thread(target=lambda: result.update(model=load(path, sparsity="dense", context=CONTEXT)[0]))
    t.start()  # load is safe off the main thread (an app's background loader)
    t.join()
    model = result["model"]
    greedy(model, 2)
    assert len(os.listdir("/proc/self/fd")) > fds
    model.flash.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads
    model.flash.reset()  # cold caches: the next token has to read (a warm one computes from its caches)
    with pytest.raises(FlashError, match="closed"):
        greedy(model, 1)  # a closed model refuses to read, with a typed error


def test_sparsifier_object_and_attach(flash_dirs):
    """load(sparsifier=...) takes an object; engine.attach moves a model onto another engine. ReLU oracle:
    both wire fc1's bias, so the tokens stay exactly the dense model's while fewer neurons are read."""
    from mlx_flash.engine.neurons import NeuronEngine

    path = flash_dirs["opt", "neurons"]
    fd = FlashDir(path)
    ref, _ = load_resident(path)
    oracle = Oracle(fd)
    model, _ = load(path, sparsifier=oracle, context=CONTEXT)
    first = model.flash
    try:
        assert first.sparsifier is oracle and set(oracle.bias) == set(range(len(fd.layers)))
        assert greedy(model, 16) == greedy(ref, 16)
        seen = len(first.stats.tokens)

        second = NeuronEngine(fd, first.reader, Oracle(fd), first.plan.capacity, first.plan.scratch)
        assert second.attach(model) is first and model.flash is second
        assert greedy(model, 16) == greedy(ref, 16)
        assert len(first.stats.tokens) == seen  # every token now goes through the new engine
        second.stats.end()
        active = [a for t in second.stats.decode_tokens() for a in t.active]
        assert 0 < np.mean(active) < fd.layers[0]["neurons"].n_units
    finally:
        model.flash.close()


class FailingReader:
    """Wraps a reader: after `ok` more batches, a batch is never read and its wait raises EIO."""

    def __init__(self, reader, ok: int):
        self.reader, self.ok = reader, ok

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def submit(self, *args, **kwargs):
        self.ok -= 1
        return self.reader.submit(*args, **kwargs) if self.ok >= 0 else None

    def wait(self, handle):
        if handle is None:
            import errno

            from mlx_flash.errors import ReadError

            raise ReadError(errno.EIO, "injected EIO", "ffn.bin")
        return self.reader.wait(handle)


def test_a_read_error_leaves_no_unread_rows_behind(flash_dirs):
    """An EIO mid-token: the error reaches the caller, and the next one-token prompt (which reads only
    its misses) gives exactly the tokens of a clean run."""
    from mlx_flash.errors import ReadError

    path = flash_dirs["llama", "neurons"]

    def one_token_run(model):  # logits of a one-token prompt: a decode step, reading only its misses
        out = model(mx.array([PROMPT[:1]]))
        model.flash.stats.end()
        return np.array(out)

    # the oracle with room for every unit: its sets change from token to token, so each token's misses
    # are admitted to the cache; its output does not depend on what is cached
    clean, _ = load(path, sparsity="oracle", density=0.3, context=CONTEXT)
    model, _ = load(path, sparsity="oracle", density=0.3, context=CONTEXT)
    try:
        want = one_token_run(clean)
        engine = model.flash
        engine.reader = FailingReader(engine.reader, ok=20)  # fails during decoding, after the prompt
        with pytest.raises(ReadError, match="injected EIO"):
            greedy(model, 16)
        engine.reader = engine.reader.reader
        np.testing.assert_allclose(one_token_run(model), want, rtol=1e-5, atol=1e-5)
    finally:
        clean.flash.close()
        model.flash.close()


def test_a_failed_read_ahead_is_not_swallowed(deep_tiny):
    """A read ahead (the next layer's units) that fails raises when it is drained: on close, after the readers
    are released (close can be called again), and nothing reports success over it."""
    from mlx_flash.errors import ReadError

    model, _ = load(deep_tiny, memory_budget=prefetch_budget(deep_tiny), sparsity="dense", context=CONTEXT)
    engine = model.flash
    greedy(model, 8)  # caches full: each layer now reads the next one's units ahead
    engine.read_ahead.drain()
    engine.reader = FailingReader(engine.reader, ok=0)
    engine.read_ahead.start(1, np.arange(4, dtype=np.int32))
    assert 1 in engine.read_ahead.pending
    with pytest.raises(ReadError, match="injected EIO"):
        engine.close()
    assert engine.read_ahead.pending == {}
    engine.close()  # released: a second close does nothing


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep")
    src = make_tiny_model_dir("llama", root / "src", num_hidden_layers=6)
    return convert(str(src), root / "flash", alignment=512, progress=False)


def prefetch_budget(path):
    """Room for caches of about a third of each layer plus the two prefetch buffers."""
    fd = FlashDir(path)
    return min_budget(fd, CONTEXT, kv_size_of(fd)) + int(0.6 * fd.ffn_bytes)


def test_dense_prefetch_reads_ahead_and_keeps_the_tokens(deep_tiny):
    """Dense decoding with the next layer read ahead: the same tokens as the resident model and as
    reading on demand, every layer's overflow taken from the prefetch buffers, inside the budget."""
    path = deep_tiny
    ref, fd = load_resident(path)
    budget = prefetch_budget(path)
    model, _ = load(path, memory_budget=budget, sparsity="dense", context=CONTEXT)
    plain, _ = load(path, memory_budget=budget, sparsity="dense", context=CONTEXT, prefetch=False)
    try:
        plan, n = model.flash.plan, fd.layers[0]["neurons"].n_units
        stride = fd.layouts["neurons"].stride
        assert 0 < plan.prefetch_rows < n and plan.prefetch_rows + plan.capacity[0]["neurons"] == n
        assert plain.flash.plan.prefetch_rows == 0 and plain.flash.read_ahead is None
        fixed = plan.resident + plan.kv_cache + plan.scratch + plan.workspace + plan.extra + plan.streaming
        assert fixed + plan.cache_bytes({"neurons": stride}) + 2 * plan.prefetch_rows * stride <= budget
        want = greedy(ref, 24)
        assert greedy(model, 24) == want == greedy(plain, 24)
        # once the caches are full, every layer's overflow came from a read started a layer earlier, all of it used
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()[4:-1]
        per_token = plan.prefetch_rows * stride * len(fd.layers)
        assert len(toks) >= 18 and all(t.bytes_requested == t.ahead_bytes == per_token for t in toks)
        assert all(t.ahead_wasted_bytes == 0 for t in toks)
    finally:
        model.flash.close()
        plain.flash.close()


def test_a_tight_budget_reads_the_first_units_ahead(deep_tiny):
    """Under two whole layers of room: no unit cached, buffers of part of a layer read its first units
    ahead and the rest streams when the layer runs; the tokens stay the resident model's."""
    path = deep_tiny
    fd = FlashDir(path)
    n, s = fd.layers[0]["neurons"].n_units, fd.layouts["neurons"].stride
    ref, _ = load_resident(path)
    model, _ = load(
        path, memory_budget=min_budget(fd, CONTEXT, kv_size_of(fd)) + n * s, sparsity="dense", context=CONTEXT
    )
    try:
        plan = model.flash.plan
        assert plan.capacity[0]["neurons"] == 0 and 0 < plan.prefetch_rows < n
        assert greedy(model, 12) == greedy(ref, 12)
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()[1:-1]
        assert all(t.ahead_bytes == plan.prefetch_rows * s * len(fd.layers) and t.ahead_wasted_bytes == 0 for t in toks)
        assert all(t.bytes_requested == n * s * len(fd.layers) for t in toks)  # the rest streamed, nothing twice
    finally:
        model.flash.close()


def test_prefetch_serves_another_thread(deep_tiny):
    """Loaded on one thread, generating on another (mlx-lm's server does): MLX streams are per thread."""
    import threading

    model, _ = load(deep_tiny, memory_budget=prefetch_budget(deep_tiny), sparsity="dense", context=CONTEXT)
    out = {}
    try:
        t = threading.Thread(target=lambda: out.update(tokens=greedy(model, 8)))
        t.start()
        t.join()
        assert len(out.get("tokens", [])) == 8 and model.flash.read_ahead is not None
    finally:
        model.flash.close()


def test_staged_units_that_a_layer_does_not_need_count_as_waste(deep_tiny):
    """Units read ahead that the layer does not need are not used and count as wasted bytes; staged rows are the
    file's bytes."""
    path = deep_tiny
    fd = FlashDir(path)
    stride = fd.layouts["neurons"].stride
    model, _ = load(path, memory_budget=prefetch_budget(path), sparsity="dense", context=CONTEXT)
    try:
        greedy(model, 4)  # fills the caches
        ahead, cache = model.flash.read_ahead, model.flash.caches[1]["neurons"]
        cached = np.flatnonzero(cache.cached_mask())[:3].astype(np.int32)
        ahead.drain()
        ahead.start(1, cached)  # units layer 1 has cached: never needed from the staging buffer
        staged = ahead.pending[1]
        staged.wait()
        want = fd.layers[1]["neurons"]
        with open(fd.ffn_path, "rb") as f:  # the staged rows are the file's bytes
            f.seek(want.offset + int(cached[0]) * want.stride)
            assert bytes(staged.host[0]) == f.read(stride)
        stats = model.flash.stats
        wasted = lambda: sum(t.ahead_wasted_bytes for t in stats.tokens) + stats.current.ahead_wasted_bytes  # noqa: E731
        before = wasted()
        greedy(model, 1)
        assert wasted() - before >= len(cached) * stride
    finally:
        model.flash.close()


def test_a_short_prompt_reads_what_its_tokens_need(flash_dirs):
    """A two-token prompt chunk after a long prompt reads at most what two decode steps would (the union of
    its tokens' active sets, less what is cached), not the whole FFN. (mlx-lm prefills all but a prompt's
    last token: a three-token prompt is a two-token chunk, then a one-token step.)"""
    path = flash_dirs["llama", "neurons"]
    fd = FlashDir(path)
    n, stride = fd.layers[0]["neurons"].n_units, fd.layouts["neurons"].stride
    model, _ = load(
        path, memory_budget=small_budget(path, 0.3, "oracle"), sparsity="oracle", density=0.2, context=CONTEXT
    )
    try:
        stats = model.flash.stats
        list(generate_step(mx.array(PROMPT * 4), model, max_tokens=2))  # a long prompt: the union is most units
        stats.end()
        assert stats.tokens[0].prefill and stats.tokens[0].active == []
        k = max(t.active[0] for t in stats.decode_tokens())  # units a decode step uses per layer
        stats.reset()
        list(generate_step(mx.array(PROMPT[:3]), model, max_tokens=1))
        stats.end()
        prompt = stats.tokens[0]
        assert prompt.prefill and 0 < prompt.bytes_requested <= 2 * k * stride * len(fd.layers) < n * stride * len(
            fd.layers
        )
    finally:
        model.flash.close()
