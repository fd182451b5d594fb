"""The same bits at every budget: with default settings (int8 activations on the CPU), a model's tokens and
log-probabilities are bit-identical whatever the memory budget, the caches' state or the read-ahead, because every
sum over units runs in one order (runtime.REDUCTION_UNITS)."""

from mlx_flash.budget import min_budget, min_streaming_budget
from mlx_flash.compute import cpu_gemv
from mlx_flash.compute.rows import RowSet
from mlx_flash.convert.build import convert
from mlx_flash.default_model import default_model_dir
from mlx_flash.engine import experts
from mlx_flash.engine.experts import REGION
from mlx_flash.engine.read_ahead import IntoCache
from mlx_flash.engine.resident import stream_groups
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import cpu_cast, kv_size_of, load
from mlx_flash.models.inspect import instantiate
from mlx_flash.models.tiny import make_tiny_model_dir
from mlx_flash.tools.synthetic import build, tiny_quantized

import mlx.core as mx
import numpy as np
import pytest

PROMPTS = ("Once upon a time there was a", "The capital of France is", "def fibonacci(n):")


def decode(path, budget, n, prompts=PROMPTS, **kw):
    """[(tokens, log-probabilities [n, vocab])] of greedy decoding each prompt, and the plan."""
    model, tokenizer = load(path, memory_budget=budget, context=128, **kw)
    try:
        out = []
        for p in prompts:
            ids = mx.array(tokenizer.encode(p) if isinstance(p, str) else p)
            steps = [(int(t), np.array(lp.astype(mx.float32))) for t, lp in generate_step(ids, model, max_tokens=n)]
            out.append(([t for t, _ in steps], np.stack([lp for _, lp in steps])))
        return out, model.flash.plan
    finally:
        model.flash.close()


def assert_same(ref, got, what):
    for i, ((t0, l0), (t1, l1)) in enumerate(zip(ref, got)):
        assert t0 == t1, (what, i)
        assert np.array_equal(l0, l1), (what, i, float(np.abs(l0 - l1).max()))


def test_default_model_every_budget():
    """SmolLM2 (the default model, real weights), 3 prompts, 32 tokens (8 through MLX's ops, whose products are
    slow on a CPU: ~0.3 s a token; every step's log-probabilities compared bit for bit): resident, 80%, 50%
    (read-ahead on and off), and below the resident floor: 30% (its embedding streamed) and 25% (attention layers
    too, no unit cached)."""
    path, n = default_model_dir(), 32 if cpu_gemv.available() else 8
    assert cpu_gemv.info().get("int8")
    ref, _ = decode(path, None, n)
    for budget, kw in (("80%", {}), ("50%", {}), ("50%", {"prefetch": False}), ("30%", {}), ("25%", {})):
        got, plan = decode(path, budget, n, **kw)
        assert_same(ref, got, (budget, kw))
        if budget in ("30%", "25%"):
            assert plan.streamed, f"{budget} should stream resident weights too"
    assert any(g.kind == "layer" for g in plan.streamed), "25% should stream attention layers"


@pytest.mark.native
def test_a_layer_held_whole_has_the_unit_steps_bits(monkeypatch):
    """Resident, a dense layer's decode step skips the unit step (NeuronEngine._decode_whole): its tokens and
    log-probabilities are the unit step's, bit for bit."""
    from mlx_flash.engine.neurons import NeuronEngine

    path, taken = default_model_dir(), []
    whole = NeuronEngine._decode_whole

    def spy(self, *args):
        y = whole(self, *args)
        taken.append(y is not None)
        return y

    monkeypatch.setattr(NeuronEngine, "_decode_whole", spy)
    fast, _ = decode(path, None, 16, PROMPTS[:1])
    assert taken and all(taken[-30:])  # every layer of the last steps
    monkeypatch.setattr(NeuronEngine, "_decode_whole", lambda self, *args: None)
    slow, _ = decode(path, None, 16, PROMPTS[:1])
    assert_same(slow, fast, "held whole")


@pytest.fixture(scope="module")
def wide_dense(tmp_path_factory):
    """A LLaMA-7B-shaped layer (4096 wide, 11008 neurons: 43 reduction blocks), two of them, random Q4 weights."""
    return build(
        "llama-7b", tmp_path_factory.mktemp("wide") / "flash", progress=False, num_hidden_layers=2, vocab_size=512
    )


def test_7b_shaped_every_budget(wide_dense):
    """The 7B shape's width: resident, three quarters of the FFN cached, a quarter (read-ahead on and off), a
    twentieth, and below the resident floor (attention and head streamed too)."""
    fd = FlashDir(wide_dense)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    ref, _ = decode(wide_dense, None, 8, prompts)
    ffn = sum(r.nbytes for r in fd.regions())
    floor = min_budget(fd, 128, kv_size_of(fd), resident=fd.resident_nbytes(cpu_cast))
    lowest = min_streaming_budget(
        fd,
        128,
        kv_size_of(fd),
        resident=fd.resident_nbytes(cpu_cast),
        groups=stream_groups(fd, instantiate(fd.config), cpu_cast, 128),
    )
    for budget, kw in (
        (floor + ffn * 3 // 4, {}),
        (floor + ffn // 4, {}),
        (floor + ffn // 4, {"prefetch": False}),
        (floor + ffn // 20, {}),
        (lowest, {}),
    ):
        got, plan = decode(wide_dense, budget, 8, prompts, **kw)
        assert_same(ref, got, (budget, kw))
    assert plan.streamed, "the last budget should stream resident weights too"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    q4 = tiny_quantized("qwen3_moe", root)
    return convert(str(q4), root / "flash", progress=False), q4


def test_moe_every_budget(tiny_moe, monkeypatch):
    """A tiny qwen3_moe: all experts cached, 3, 2 and 1 expert slots per layer, with and without the read-ahead (as
    it decides, and reading every layer's guess however wrong: slots read ahead for nothing are taken by misses)."""
    tiny_moe, _ = tiny_moe
    fd = FlashDir(tiny_moe)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    ref, _ = decode(tiny_moe, None, 16, prompts)
    slot = sum(REGION in layer for layer in fd.layers) * fd.layouts[REGION].stride
    for slots in (3, 2, 1):
        got, _ = decode(tiny_moe, min_budget(fd, 128, kv_size_of(fd)) + slots * slot, 16, prompts)
        assert_same(ref, got, slots)
    started = []
    start = IntoCache.start
    monkeypatch.setattr(IntoCache, "start", lambda self, *a, **kw: started.append(1) or start(self, *a, **kw))
    for slots, precision in ((3, experts.PRECISION), (2, experts.PRECISION), (2, 0.0)):
        monkeypatch.setattr(experts, "PRECISION", precision)
        got, _ = decode(tiny_moe, min_budget(fd, 128, kv_size_of(fd)) + slots * slot, 16, prompts, prefetch=True)
        assert_same(ref, got, f"read-ahead, {slots}, {precision}")
    assert len(started) >= 16 * len(prompts)  # (the last run's alone: a layer a token)


def test_partial_sums_do_not_depend_on_the_call():
    """The kernels' partial sums (dst) over rows given by address equal each block computed alone from one buffer."""
    rng = np.random.default_rng(0)
    n, k, bits = 256, 96, 4
    w = rng.integers(0, 2**32, size=(k, n * bits // 32), dtype=np.uint32)
    s = rng.standard_normal((k, n // 32)).astype(np.float32)
    b = rng.standard_normal((k, n // 32)).astype(np.float32)
    c = rng.standard_normal(k).astype(np.float32)
    q = cpu_gemv.QuantRows.of_matrix(mx.array(w), mx.array(s), mx.array(b), 32, bits)
    dst = np.repeat(np.arange(3, dtype=np.int32), [40, 24, 32])
    alone = [cpu_gemv.row_axpy(c[dst == i], q, np.flatnonzero(dst == i)) for i in range(3)]
    together = cpu_gemv.row_axpy(c, q, None, dst, 3)
    assert all(np.array_equal(a, t) for a, t in zip(alone, together))
    # the same rows split between two buffers, read by address
    rows = mx.array(np.concatenate([w.view(np.uint8), s.view(np.uint8), b.view(np.uint8)], axis=1))
    half = [mx.array(np.ascontiguousarray(np.array(rows)[i::2])) for i in (0, 1)]
    mx.eval(half)
    rs = RowSet(half, np.arange(k) % 2, np.arange(k) // 2)
    wb, sb = w.shape[1] * 4, s.shape[1] * 4
    qa = cpu_gemv.QuantRows(half[0], 0, 0, half[0], wb, 0, half[0], wb + sb, 0, n, bits, 32, mx.float32)
    by_address = cpu_gemv.row_axpy(c, qa, cpu_gemv.Addresses(rs.addresses()), dst, 3)
    assert np.array_equal(by_address, together)


def test_exact_mode_is_mlx_lm_text(tiny_moe, capsys):
    """`generate --exact` (float32 activations) prints stock mlx-lm's greedy text, at a budget of one expert slot."""
    from mlx_flash.generate import main

    import mlx_lm

    flash, q4 = tiny_moe
    model, tokenizer = mlx_lm.load(str(q4))
    want = mlx_lm.generate(model, tokenizer, "The capital of France is", max_tokens=12)
    fd = FlashDir(flash)
    budget = (
        min_budget(fd, 64, kv_size_of(fd)) + sum(REGION in layer for layer in fd.layers) * fd.layouts[REGION].stride
    )
    try:
        assert main(
            [
                "--model",
                str(flash),
                "--prompt",
                "The capital of France is",
                "--ignore-chat-template",
                "-m",
                "12",
                "--exact",
                "--memory-budget",
                str(budget),
                "--temp",
                "0",
            ]
        ) in (0, None)
    finally:
        cpu_gemv.set_int8_activations(True)
    assert want and want in capsys.readouterr().out


@pytest.mark.parametrize("ops", [False, True])
def test_tiny_dense_every_budget(tmp_path, monkeypatch, ops):
    """A tiny llama with 3 reduction blocks a layer, natively and through MLX's ops (the path Metal and long
    prompts take): all cached, most, a third, none (every unit streamed), read-ahead on and off."""
    if ops:
        monkeypatch.setattr(cpu_gemv, "enabled", False)
    src = make_tiny_model_dir("llama", tmp_path / "src", intermediate_size=640)
    flash = convert(str(src), tmp_path / "flash", progress=False)
    fd = FlashDir(flash)
    prompts = [list(range(1, 40)), [7, 3, 9]]  # a long prompt (MLX ops) and a short one
    ref, _ = decode(flash, None, 12, prompts)
    ffn = sum(r.nbytes for r in fd.regions())
    floor = min_budget(fd, 128, kv_size_of(fd), resident=fd.resident_nbytes(cpu_cast))
    for budget, kw in (
        (floor + ffn * 2 // 3, {}),
        (floor + ffn // 3, {}),
        (floor + ffn // 3, {"prefetch": False}),
        (floor, {}),
    ):
        got, _ = decode(flash, budget, 12, prompts, **kw)
        assert_same(ref, got, (budget, kw))
