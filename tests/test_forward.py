"""The forward pass (engine/forward.py) through MLX's own ops, the path a Mac runs: several sequences in one pass each
compute as alone, bit for bit, reading their units once; a verification pass computes each position as a decode step;
the products whose rows it relies on are row-independent on the CPU; the backend switch; stages' bodies checked."""

import subprocess
import sys
from pathlib import Path

from mlx_flash.budget import min_budget
from mlx_flash.compute import cpu_gemv
from mlx_flash.compute import rows as row_rules
from mlx_flash.convert import convert
from mlx_flash.engine.forward import MLXForward
from mlx_flash.errors import FlashError
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41], [7, 250, 12, 99, 5]]


@pytest.fixture
def mlx_backend(monkeypatch):
    """`load(backend="mlx")` turns the native kernels off for the process: back on after the test."""
    monkeypatch.setattr(cpu_gemv, "enabled", cpu_gemv.enabled)
    return "mlx"


@pytest.fixture(scope="module")
def tiny_opt(tmp_path_factory):
    root = tmp_path_factory.mktemp("opt")
    return convert(str(make_tiny_model_dir("opt", root / "src")), root / "flash", progress=False)


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    """A dense model whose FFN rows are float32 (converted unquantised): float products, whose rows round by the
    rows beside them."""
    root = tmp_path_factory.mktemp("float_llama")
    src = make_tiny_model_dir("llama", root / "src", hidden_size=256, intermediate_size=1024, num_hidden_layers=2)
    return convert(str(src), root / "flash", progress=False)


def test_mlx_quantised_products_are_row_independent(mlx_ops):
    """What a batched pass's bits rely on (compute.rows.independent): on the CPU, a row of MLX's quantised products
    is what it is alone, whatever other rows or weight rows a call holds (transposed, not, gathered); a float matmul's
    need not be, and runs per sequence."""
    assert row_rules.independent(True) and not row_rules.independent(False)
    rng = np.random.default_rng(0)
    w, s, b = mx.quantize(mx.array(rng.standard_normal((768, 576)).astype(np.float32)), 64, 4)
    x = mx.array(rng.standard_normal((9, 576)).astype(np.float32))
    h = mx.array(rng.standard_normal((9, 768)).astype(np.float32))
    for rows, t in ((x, True), (h, False)):
        whole = mx.quantized_matmul(rows, w, s, b, transpose=t, group_size=64, bits=4)
        alone = [mx.quantized_matmul(rows[i : i + 1], w, s, b, transpose=t, group_size=64, bits=4) for i in range(9)]
        assert mx.array_equal(whole, mx.concatenate(alone))
    part = mx.quantized_matmul(x, w[256:512], s[256:512], b[256:512], transpose=True, group_size=64, bits=4)
    assert mx.array_equal(part, mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)[:, 256:512])
    blocks = [a.reshape(3, 256, -1) for a in (w, s, b)]
    hb = h.reshape(9, 3, 256).transpose(1, 0, 2)
    together = mx.gather_qmm(hb, *blocks, rhs_indices=mx.arange(3), transpose=False, group_size=64, bits=4)
    one = mx.gather_qmm(hb[1:2, :1], *blocks, rhs_indices=mx.array([1]), transpose=False, group_size=64, bits=4)
    assert mx.array_equal(together[1:2, :1], one)


def solo_and_batched(model, prompts, steps):
    """Each sequence's logits alone (its prompt, then greedy steps) and all of them in passes of every sequence, with
    the device bytes of each way."""
    stats = model.flash.stats
    before = stats.device_bytes()
    solo = []
    for p in prompts:
        cache = model.make_cache()
        out = [np.array(model.forward(p, cache, prompt=True).astype(mx.float32))[0, -1]]
        for _ in range(steps):
            out.append(np.array(model.forward([int(out[-1].argmax())], cache).astype(mx.float32))[0, -1])
        solo.append(out)
    alone = stats.device_bytes() - before
    before = stats.device_bytes()
    caches = [model.make_cache() for _ in prompts]
    together = [[r] for r in model.forward.run(list(zip(prompts, caches)), True)]
    for _ in range(steps):
        last = model.forward.run([([int(o[-1].argmax())], c) for o, c in zip(together, caches)])
        for o, row in zip(together, last):
            o.append(row)
    return solo, together, alone, stats.device_bytes() - before


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("which", ["smol", "tiny_qwen3_moe", "float_llama"])
def test_a_batched_mlx_pass_is_each_sequence_alone(which, request, mlx_backend, monkeypatch, split):
    """SmolLM2 at 50% (units, its embedding and head streamed), a tiny MoE with two expert slots a layer and a dense
    model of float rows streamed, through MLX's forward: three sequences in one pass give each its solo logits bit for
    bit and read the units once; also with every product split per sequence, as on a GPU (whose matrix-vector and
    tiled kernels differ)."""
    monkeypatch.setattr(row_rules, "SPLIT_ALWAYS", split)
    path = request.getfixturevalue(which)
    fd = FlashDir(path)
    budget = "50%" if which == "smol" else min_budget(fd, 64, kv_size_of(fd))  # (float_llama: its units streamed)
    if which == "tiny_qwen3_moe":
        budget += 2 * len(fd.layers) * fd.layouts["experts"].stride
    model, _ = load(path, memory_budget=budget, context=64, backend=mlx_backend)
    try:
        assert isinstance(model.forward, MLXForward) and not model.forward.native
        solo, together, alone, batched = solo_and_batched(model, PROMPTS, 5)
    finally:
        model.flash.close()
    for s, t in zip(solo, together):
        assert all(np.array_equal(a, b) for a, b in zip(s, t))
    assert batched < (0.95 if which == "tiny_qwen3_moe" else 0.6) * alone


def test_rope_at_a_vector_of_offsets_is_each_row_at_its_own(mlx_ops):
    """What a stacked mixer's bits rely on (engine.forward._stacks): on the CPU, mx.fast.rope of a batch at a vector
    of offsets, one a batch row (as mlx-lm's RoPE modules take its batched caches' offsets), gives each row what it
    gives at its own offset alone."""
    assert row_rules.independent(True)
    rng = np.random.default_rng(0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    ropes = [nn.RoPE(64), nn.RoPE(64, traditional=True), nn.RoPE(32, base=500000.0, scale=0.5)]
    ropes += [initialize_rope(64, 500000.0, False, llama3, 131072), initialize_rope(64, 10000.0, False, yarn, 16384)]
    offsets = rng.integers(0, 5000, 8).tolist()
    for rope in ropes:
        for dtype in (mx.float32, mx.bfloat16):
            for m in (1, 3):
                x = mx.array(rng.standard_normal((8, 9, m, 64)).astype(np.float32)).astype(dtype)
                alone = mx.concatenate([rope(x[i : i + 1], offset=o) for i, o in enumerate(offsets)])
                assert mx.array_equal(rope(x, offset=mx.array(offsets)), alone), (type(rope).__name__, dtype, m)


def count_calls(module, calls: list):
    """Counts `module`'s calls into calls[0] (its class replaced by a subclass that does)."""
    cls = type(module)

    def __call__(self, *args, **kwargs):
        calls[0] += 1
        return cls.__call__(self, *args, **kwargs)

    module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__})


@pytest.mark.parametrize("which", ["smol", "tiny_qwen3_moe"])
def test_a_batched_mlx_pass_stacks_the_attention_of_sequences_of_a_length(which, request, mlx_backend, monkeypatch):
    """Through MLX's forward on the CPU, each layer's attention runs once over the sequences of a pass of one length
    (its projections and RoPE once for all of them, each one's keys and attention its own), checked at each length
    against their calls alone: prompts of 5, 2, 2 and 3 tokens, then decode steps, each sequence's logits its solo
    ones bit for bit. A projection then computes once a pass, and per sequence where products are split (a GPU)."""
    model, _ = load(request.getfixturevalue(which), memory_budget=None, context=64, backend=mlx_backend)
    try:
        attention = [layer.self_attn for layer in model.layers]
        solo, together, _, _ = solo_and_batched(model, [[1, 2, 3, 4, 5], [40, 41], [7, 250], [9, 8, 7]], 4)
        assert all(vars(a).get("_stacked") == {1: True, 2: True} for a in attention)
        calls = [0]
        count_calls(attention[0].q_proj, calls)
        caches = [model.make_cache() for _ in range(4)]
        model.forward.run([([5 + i], c) for i, c in enumerate(caches)])
        assert calls == [1]
        monkeypatch.setattr(row_rules, "SPLIT_ALWAYS", True)
        model.forward.run([([9 + i], c) for i, c in enumerate(caches)])
        assert calls == [1 + 4]
    finally:
        model.flash.close()
    for s, t in zip(solo, together):
        assert all(np.array_equal(a, b) for a, b in zip(s, t))


class FirstOffsetRoPE(nn.RoPE):
    """RoPE that, given a vector of offsets, rotates every row by the first: a mixer that does not batch as mlx-lm's
    do (alone, at one offset, it is nn.RoPE)."""

    def __call__(self, x, offset=0):
        return super().__call__(x, offset=offset if isinstance(offset, int) else offset[0])


class OneOffsetRoPE(nn.RoPE):
    """RoPE that takes one offset only (int() of a vector raises)."""

    def __call__(self, x, offset=0):
        return super().__call__(x, offset=int(offset))


BAD_ROPES = [(FirstOffsetRoPE, {1: False, 2: True}), (OneOffsetRoPE, {1: False, 2: False})]


@pytest.mark.parametrize("rope, stacks", BAD_ROPES)
def test_a_mixer_that_does_not_stack_runs_per_sequence(smol, mlx_backend, rope, stacks):
    """A mixer whose call over several sequences at once would differ from their calls alone (here its RoPE, at
    their different offsets) or fails runs per sequence, found at its first such call: each sequence's logits its
    solo ones bit for bit. (Two prompts of 2 tokens start at offset 0: the first RoPE's call over them is right.)"""
    model, _ = load(smol, memory_budget=None, context=64, backend=mlx_backend)
    try:
        for layer in model.layers:
            layer.self_attn.rope = rope(64, base=layer.self_attn.rope.base)
        solo, together, _, _ = solo_and_batched(model, [[40, 41], [7, 250], [1, 2, 3, 4, 5]], 3)
        assert all(vars(layer.self_attn)["_stacked"] == stacks for layer in model.layers)
    finally:
        model.flash.close()
    for s, t in zip(solo, together):
        assert all(np.array_equal(a, b) for a, b in zip(s, t))


@pytest.mark.native
def test_beside_the_native_kernels_a_prompt_pass_computes_each_sequence_alone(smol):
    """MLX's forward where the native kernels compute its quantised products (a quantised KV cache, which the native
    step does not take): they compute more rows than cpu_gemv.NATIVE_ROWS as float matmuls, whose rows round by the
    rows, so a pass of several prompts computes each one's products alone, its logits its solo ones bit for bit."""
    assert not row_rules.independent(True)
    model, _ = load(smol, memory_budget=None, context=64, kv_bits=8)
    try:
        assert isinstance(model.forward, MLXForward)
        prompts = [list(range(1, 21)), list(range(30, 40)), list(range(50, 58))]
        assert sum(map(len, prompts)) > cpu_gemv.NATIVE_ROWS
        solo, together, _, _ = solo_and_batched(model, prompts, 0)
    finally:
        model.flash.close()
    assert all(np.array_equal(s[0], t[0]) for s, t in zip(solo, together))


def test_a_verification_pass_computes_each_position_as_a_decode_step(smol, mlx_backend):
    """MLX's forward, a pass of several positions that is not a prompt: each position's logits are those of decode
    steps of it alone, bit for bit (its attention one row at a time), and its units are read once."""
    model, _ = load(smol, memory_budget="50%", context=64, backend=mlx_backend)
    try:
        a, b = model.make_cache(), model.make_cache()
        for cache in (a, b):
            model.forward(PROMPTS[0], cache, prompt=True)
        tokens = [11, 12, 13, 14]
        before = model.flash.stats.device_bytes()
        steps = [np.array(model.forward([t], a).astype(mx.float32))[0, -1] for t in tokens]
        one_by_one = model.flash.stats.device_bytes() - before
        before = model.flash.stats.device_bytes()
        verified = np.array(model.forward(tokens, b).astype(mx.float32))[0]
        at_once = model.flash.stats.device_bytes() - before
    finally:
        model.flash.close()
    assert all(np.array_equal(x, y) for x, y in zip(steps, verified))
    assert at_once < 0.5 * one_by_one


def test_a_body_that_needs_one_cache_runs_its_sequences_in_turn(tiny_opt, mlx_backend):
    """OPT's body positions its tokens from its first cache's offset, which a pass of several sequences lacks: its
    passes go one sequence at a time (Forward.run), each its solo logits."""
    fd = FlashDir(tiny_opt)
    budget = min_budget(fd, 64, kv_size_of(fd)) + fd.ffn_bytes // 2
    model, _ = load(tiny_opt, memory_budget=budget, context=64, backend=mlx_backend)
    try:
        solo, together, _, _ = solo_and_batched(model, [[1, 2, 3], [4, 5]], 3)
        assert not model.forward.segmentable
    finally:
        model.flash.close()
    for s, t in zip(solo, together):
        assert all(np.array_equal(a, b) for a, b in zip(s, t))


def test_a_stage_needs_a_body_that_passes_its_rows_on(tmp_path, mlx_backend):
    """Gemma's body scales the embedding before its first layer: rows sent by another stage would be scaled again, so
    it cannot run as a stage; llama's can."""
    for arch, ok in (("gemma3_text", False), ("llama", True)):
        path = convert(str(make_tiny_model_dir(arch, tmp_path / arch)), tmp_path / f"{arch}-flash", progress=False)
        model, _ = load(path, context=32, backend=mlx_backend)
        try:
            if ok:
                model.forward.check_stage()
            else:
                with pytest.raises(ValueError, match="embedding"):
                    model.forward.check_stage()
        finally:
            model.flash.close()


def test_the_backend_switch(smol, mlx_backend):
    """--backend mlx: MLX's forward, the kernels off (the stats say which runs); --backend native where they are off:
    a FlashError saying why."""
    model, _ = load(smol, context=32, backend="mlx")
    model.flash.close()
    assert not cpu_gemv.available() and model.flash.forward.why == "--backend mlx"
    with pytest.raises(FlashError, match="native CPU step does not run"):
        load(smol, context=32, backend="native")
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.generate", "--model", str(smol), "--prompt", "Hi", "-m", "4", "--stats",
         "--backend", "mlx", "--memory-budget", "50%"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "forward: mlx (the native CPU step does not run: --backend mlx)" in r.stdout
    assert "host synchronisations a token" in r.stdout


def test_gpu_check_skips_where_mlx_has_no_gpu():
    """benchmarks/gpu_check.py runs where MLX has Metal or CUDA, and says it skipped elsewhere (exit 0)."""
    if mx.metal.is_available():
        pytest.skip("this machine has a GPU: the script runs for real")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "skipped" in r.stdout, r.stdout + r.stderr
