"""The flash runtime: streamed FFNs equal the dense model, caches really evict, stats add up, budgets hold."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlx_flash import BudgetError, FlashError
from mlx_flash.budget import min_budget, parse_size
from mlx_flash.convert import convert
from mlx_flash.ffn import ACTIVATIONS, project
from mlx_flash.flash_format import FlashDir
from mlx_flash.loader import load, load_resident
from mlx_flash.models.tiny import make_tiny_model_dir

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


def small_budget(path, ffn_fraction=0.1):
    """Resident + KV cache + scratch + `ffn_fraction` of the FFN: caches far smaller than the FFN."""
    fd = FlashDir(path)
    return min_budget(fd, CONTEXT) + int(ffn_fraction * fd.ffn_bytes)


def greedy(model, n=64):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("arch", ["llama", "opt", "phi3"])
@pytest.mark.parametrize("sparsity", ["oracle", "dense"])
def test_streamed_tokens_equal_dense(flash_dirs, arch, sparsity):
    path = flash_dirs[arch, "neurons"]
    ref, fd = load_resident(path)
    model, _ = load(path, memory_budget=small_budget(path), sparsity=sparsity, context=CONTEXT)
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
    model, _ = load(path, memory_budget=small_budget(path, 0.3), sparsity="dip", density=0.5, gamma=gamma, context=CONTEXT)
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
    budget = small_budget(path, 0.2)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model, _ = load(path, memory_budget=budget, sparsity="oracle", context=CONTEXT)
    try:
        greedy(model, 16)
        oracle_copy = model.flash.sparsifier.nbytes  # a test instrument, outside the budget by design
        assert mx.get_peak_memory() - base <= budget + oracle_copy
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
    with pytest.raises(FlashError, match="closed"):
        greedy(model, 1)  # a closed model refuses to read, with a typed error


def test_sparsifier_object_and_attach(flash_dirs):
    """load(sparsifier=...) takes an object; engine.attach moves a model onto another engine. ReLU oracle:
    both wire fc1's bias, so the tokens stay exactly the dense model's while fewer neurons are read."""
    from mlx_flash.runtime import FlashEngine
    from mlx_flash.sparsity import Oracle

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

        second = FlashEngine(fd, first.reader, Oracle(fd), first.plan.capacity, first.plan.scratch)
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
