"""Mixture-of-experts models from flash: experts as units, the model's own router as the selector."""

import json

import mlx_flash  # noqa: F401
from mlx_flash.budget import min_budget
from mlx_flash.compute import cpu_gemv
from mlx_flash.convert.build import convert
from mlx_flash.convert.source import copy_tokenizer, load_source_model
from mlx_flash.engine import experts
from mlx_flash.engine.experts import REGION, expert_arrays, switch_paths
from mlx_flash.errors import FlashError
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.io.reader import DEFAULT_MAX_GAP_BYTES
from mlx_flash.loader import kv_size_of, load, load_resident, native_expected
from mlx_flash.models.tiny import TINY_MOE_ARCHS, make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest

PROMPT = mx.array([1, 5, 9, 33, 70, 2, 11])


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """arch -> (4-bit mlx-lm source dir (experts stacked), its flash dir converted with convert's defaults, the float
    Hugging Face dir it was quantised from)."""
    from mlx_lm.utils import quantize_model, save_model

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch in TINY_MOE_ARCHS:
        src_dir = make_tiny_model_dir(arch, root / f"{arch}-float")  # Hugging Face names: a tensor per expert
        model, config = load_source_model(src_dir, lazy=False)
        model, config = quantize_model(model, config, group_size=32, bits=4)
        q = root / f"{arch}-q4"
        save_model(q, model)
        (q / "config.json").write_text(json.dumps(config))
        copy_tokenizer(src_dir, q)
        out[arch] = (q, convert(str(q), root / f"{arch}-flash", progress=False), src_dir)
    return out


@pytest.fixture
def float_activations():
    """The native kernels with float32 activations: the same arithmetic as mlx-lm's, to compare against it."""
    cpu_gemv.set_int8_activations(False)
    yield
    cpu_gemv.set_int8_activations(True)


def greedy(model, n=12):
    return [int(t) for t, _ in generate_step(PROMPT, model, max_tokens=n)]


def slots_budget(fd, slots):
    """A budget that leaves `slots` expert slots per layer (the read-ahead reads into them)."""
    floor = min_budget(fd, 64, kv_size_of(fd), native=native_expected(fd))  # (for the forward load gives)
    return floor + slots * sum(REGION in l for l in fd.layers) * fd.layouts[REGION].stride


@pytest.mark.parametrize("arch", TINY_MOE_ARCHS)
def test_experts_are_the_source_codes(moe_dirs, arch):
    """Each expert unit holds the source's codes, scales and biases bit for bit; routers stay resident."""
    src_dir, flash_dir, _ = moe_dirs[arch]
    src, _ = load_source_model(src_dir, lazy=False)
    fd = FlashDir(flash_dir)
    modules = dict(src.named_modules())
    for i, path in switch_paths(src).items():
        want = expert_arrays(modules[path])
        got = fd.unpack_layer(i)
        assert set(got) == set(want)
        for k in want:
            assert np.array_equal(np.array(got[k]), np.array(want[k])), (i, k)
    assert not any("switch_mlp" in k for k in fd.load_resident())
    assert fd.layouts[REGION].stride % fd.alignment == 0  # read straight into a cache row
    assert [REGION in layer for layer in fd.layers] == [i in switch_paths(src) for i in range(len(fd.layers))]
    fd.verify()


@pytest.mark.parametrize("arch", TINY_MOE_ARCHS)
def test_streamed_experts_equal_stock_mlx_lm(moe_dirs, arch, float_activations):
    """Under budgets that hold every expert, one slot per layer (fewer than top-k: the rest streamed
    uncached) and three without the read-ahead, and two (top-k) with it, greedy tokens equal stock mlx-lm's on the
    same weights; logits to float rounding."""
    src_dir, flash_dir, _ = moe_dirs[arch]
    src, _ = load_source_model(src_dir, lazy=False)
    ref_tokens, ref_logits = greedy(src), src(PROMPT[None])
    fd = FlashDir(flash_dir)
    for budget, ahead in (
        (None, None),
        (slots_budget(fd, 1), False),
        (slots_budget(fd, 3), False),
        (slots_budget(fd, 2), None),
    ):
        model, _ = load(flash_dir, memory_budget=budget, context=64, prefetch=ahead)
        try:
            assert (model.flash.read_ahead is not None) == (ahead is None)  # on by default
            assert model.forward.native == (arch == "qwen3_moe" and cpu_gemv.available()), model.forward.why
            assert greedy(model) == ref_tokens, budget
            assert mx.abs(model(PROMPT[None]) - ref_logits).max().item() < 1e-4
            if budget is not None:
                assert model.flash.stats.peak_rss() is not None
        finally:
            model.flash.close()


def test_mlx_ops_path_reads_ahead_and_evicts_in_place(moe_dirs, mlx_ops, float_activations):
    """Through MLX's ops (the Metal path's arithmetic): three expert slots per layer with the read-ahead, so experts
    are evicted in place every step and others read ahead into their slots; greedy tokens equal stock mlx-lm's, no
    row was ever moved."""
    src_dir, flash_dir, _ = moe_dirs["qwen3_moe"]
    src, _ = load_source_model(src_dir, lazy=False)
    fd = FlashDir(flash_dir)
    model, _ = load(flash_dir, memory_budget=slots_budget(fd, 3), context=64, prefetch=True)
    try:
        assert not model.forward.native  # (the native step is off with the kernels)
        assert greedy(model) == greedy(src)
        caches = [c[REGION] for c in model.flash.caches if c]
        assert sum(c.stats.evicted for c in caches) > 0 and sum(c.stats.moved_rows for c in caches) == 0
        assert sum(t.ahead_bytes for t in model.flash.stats.tokens) > 0
    finally:
        model.flash.close()


def _check_against(src, flash_dir, budgets):
    """Greedy tokens equal `src`'s (an mlx-lm model) and logits agree to float rounding at each budget (slots/layer)."""
    ref_tokens, ref_logits = greedy(src), src(PROMPT[None])
    fd = FlashDir(flash_dir)
    for slots in budgets:
        model, _ = load(flash_dir, memory_budget=None if slots is None else slots_budget(fd, slots), context=64)
        try:
            assert greedy(model) == ref_tokens, slots
            assert mx.abs(model(PROMPT[None]) - ref_logits).max().item() < 1e-4
        finally:
            model.flash.close()


@pytest.mark.parametrize("arch", TINY_MOE_ARCHS)
def test_hugging_face_directory_with_a_tensor_per_expert(moe_dirs, arch, tmp_path, float_activations):
    """A float Hugging Face directory (a tensor per expert, stacked by mlx-lm's sanitize) converts with its floats
    kept and streams as mlx-lm runs it."""
    hf = moe_dirs[arch][2]
    flash_dir = convert(str(hf), tmp_path / "flash", progress=False)
    assert FlashDir(flash_dir).manifest["ffn"]["quantization"]["gate_proj"] is None
    _check_against(load_source_model(hf, lazy=False)[0], flash_dir, (None, 1))


@pytest.mark.parametrize("mode,bits,group_size", [("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)])
def test_gpt_oss_mxfp4_experts_stay_as_stored(moe_dirs, tmp_path, float_activations, mode, bits, group_size):
    """gpt-oss publishes its experts in mxfp4 (e2m1 codes, a uint8 power-of-two scale per 32, no biases), and MLX has
    two more such modes: each expert unit keeps those bytes, and streamed at one slot per layer the model is
    mlx-lm's on the same weights."""
    from mlx_lm.utils import quantize_model, save_model

    src, config = load_source_model(moe_dirs["gpt_oss"][2], lazy=False)
    src, config = quantize_model(src, config, group_size=group_size, bits=bits, mode=mode)
    save_model(tmp_path / "mx", src)
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    copy_tokenizer(moe_dirs["gpt_oss"][2], tmp_path / "mx")
    src, _ = load_source_model(tmp_path / "mx", lazy=False)
    flash_dir = convert(str(tmp_path / "mx"), tmp_path / "flash", progress=False)
    fd = FlashDir(flash_dir)
    assert fd.manifest["ffn"]["quantization"]["down_proj"] == {"bits": bits, "group_size": group_size, "mode": mode}
    got, want = fd.unpack_layer(1), expert_arrays(dict(src.named_modules())[switch_paths(src)[1]])
    assert set(got) == set(want) and not any(k.endswith(".biases") for k in got)
    assert all(np.array_equal(np.array(got[k]), np.array(want[k])) for k in want)
    _check_against(src, flash_dir, (None, 1))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3"])
def test_gguf_moe_as_llama_cpp_writes_it(tmp_path, float_activations, model_type):
    """MoE GGUFs as llama.cpp writes them (stacked experts ffn_*_exps, float router ffn_gate_inp): qwen3moe, Mixtral
    (llama.cpp's "llama" with expert_count), qwen2moe (q/k/v biases, a shared expert *_shexp behind a 1-D gate),
    olmoe (q/k norms over all heads), gpt-oss (MXFP4 experts with biases, sinks, sliding layers, YaRN), deepseek2
    (MLA as k_b / v_b, a dense first layer, a shared expert, grouped sigmoid routing with exp_probs_b). Converted,
    its experts keep the GGUF's bytes (Q4_0: read in place, its blocks), the model is mlx-lm's on the same weights
    (gguf_to_mlx_dir) bit for bit, and streaming gives its tokens and logits."""
    from mlx_flash.convert.gguf import gguf_to_mlx_dir
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    gguf = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, **tiny_moe(model_type))
    flash_dir = convert(str(gguf), tmp_path / "flash", progress=False)
    fd = FlashDir(flash_dir)
    assert fd.manifest["architecture"] == model_type
    experts = 3 * 256 * 64  # weights per expert
    if model_type == "gpt_oss":  # MXFP4's own bytes (17 per 32: e2m1 codes and a scale byte), the float32 biases
        assert fd.manifest["ffn"]["quantization"]["down_proj"] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
        assert sum(c.nbytes for c in fd.layouts[REGION].components) == experts * 17 // 32 + (64 + 64 + 256) * 4
    else:  # Q4_0's own bytes (18 per 32 weights: codes and a float16 scale), read in place from the GGUF
        assert fd.manifest["ffn"]["quantization"]["down_proj"] == {"ggml": "Q4_0", "values": 64}
        assert sum(c.nbytes for c in fd.layouts[REGION].components) == experts * 18 // 32
        assert fd.sources is not None and not (flash_dir / "ffn.bin").exists()
    src, _ = load_source_model(gguf_to_mlx_dir(gguf, tmp_path / "mlx"), lazy=False)
    cpu_gemv.enabled = False  # MLX's ops on both sides: the same weights give the same bits
    try:
        assert mx.array_equal(load_resident(flash_dir)[0](PROMPT[None]), src(PROMPT[None]))
    finally:
        cpu_gemv.enabled = True
    _check_against(load_resident(flash_dir, dtype=mx.float32)[0], flash_dir, (None, 1, 3))  # the CPU's float32


def test_deepseek2_gguf_with_softmax_routing_is_refused(tmp_path):
    """DeepSeek-V2's softmax routing is not mlx-lm's deepseek_v3 (sigmoid): refused, not converted wrong."""
    from mlx_flash.convert import gguf_archs as gguf
    from mlx_flash.errors import UnsupportedArchitectureError

    spec = gguf.ARCHITECTURES["deepseek2"]
    meta = gguf.Meta({"general.architecture": "deepseek2", "deepseek2.expert_gating_func": 1}, tmp_path / "v2.gguf")
    with pytest.raises(UnsupportedArchitectureError, match="softmax"):
        spec.make_config(meta, {}, spec)


def test_streamed_equals_all_cached_with_int8_activations(moe_dirs):
    """The default (int8) kernels: streaming under a budget gives the all-cached model's logits exactly."""
    _, flash_dir, _ = moe_dirs["qwen3_moe"]
    fd = FlashDir(flash_dir)
    full, _ = load(flash_dir, context=64)
    small, _ = load(flash_dir, memory_budget=slots_budget(fd, 1), context=64)
    try:
        assert greedy(full) == greedy(small)
        assert mx.array_equal(full(PROMPT[None]), small(PROMPT[None]))
    finally:
        full.flash.close()
        small.flash.close()


@pytest.mark.native
def test_the_native_step_computes_a_long_prompt_row_by_row(moe_dirs):
    """On the native step an MoE block's products (router, experts) over a prompt longer than cpu_gemv.NATIVE_ROWS
    are native too, each row alone: one pass of 48 positions gives the logits passes of 8 give, bit for bit (MLX's
    CPU ops took such a pass before: many times slower, and rounding by the rows)."""
    _, flash_dir, _ = moe_dirs["qwen3_moe"]
    model, _ = load(flash_dir, context=64)
    try:
        assert model.forward.native, model.forward.why
        prompt = mx.array(np.random.default_rng(0).integers(3, 100, 48))
        assert len(prompt) > cpu_gemv.NATIVE_ROWS
        whole, cut = (next(generate_step(prompt, model, max_tokens=1, prefill_step_size=s))[1] for s in (64, 8))
        assert mx.array_equal(whole, cut)
    finally:
        model.flash.close()


@pytest.fixture(scope="module")
def moe_copied(moe_dirs, tmp_path_factory):
    """mixtral's flash directory converted with --copy: its experts in ffn.bin (moe_dirs' are read in place)."""
    return convert(str(moe_dirs["mixtral"][0]), tmp_path_factory.mktemp("copied") / "flash", progress=False, copy=True)


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("in_place", [True, False])
def test_bytes_read_are_the_missed_experts(moe_dirs, moe_copied, read_ahead, in_place):
    """The runtime asks for exactly the experts it missed (admitted or streamed uncached), whole, and with the
    read-ahead the predicted experts that were not routed; what the device read adds only the reader's gap fills
    (from ffn.bin, whole experts here: a tiny expert is smaller than the largest gap; in place, the bytes between an
    expert's components)."""
    flash_dir = moe_dirs["mixtral"][1] if in_place else moe_copied
    fd = FlashDir(flash_dir)
    assert (fd.sources is not None) == in_place
    stride = next(layer[REGION] for layer in fd.layers if layer).unit_bytes
    for budget in (slots_budget(fd, 2), None):
        model, _ = load(flash_dir, memory_budget=budget, context=64, direct=False, prefetch=read_ahead)
        try:
            assert (model.flash.read_ahead is not None) == read_ahead
            greedy(model, 8)
            model.flash.stats.end()
            tokens = model.flash.stats.tokens
            misses, requested = sum(t.misses for t in tokens), sum(t.bytes_requested for t in tokens)
            wasted = sum(t.ahead_wasted_bytes for t in tokens)
            device = model.flash.stats.device_bytes()  # the reader's own count
            if in_place:  # (the window of an expert at its file's end is cut there)
                assert misses * fd.layouts[REGION].nbytes <= requested - wasted <= misses * stride and misses > 0
            else:
                assert requested == misses * stride + wasted and misses > 0
            assert sum(t.bytes_read for t in tokens) == device >= requested
            if not in_place:
                assert (device - requested) % stride == 0 and (device == requested or stride <= DEFAULT_MAX_GAP_BYTES)
            assert sum(t.hits for t in tokens) > 0
            routed, predicted = sum(t.routed for t in tokens), sum(t.predicted for t in tokens)
            if read_ahead and budget is not None:  # experts read ahead, some of them routed
                assert sum(t.ahead_bytes for t in tokens) > wasted and 0 < predicted <= routed
            elif not read_ahead:
                assert routed == predicted == sum(t.ahead_bytes for t in tokens) == 0
        finally:
            model.flash.close()


def test_streamed_chunks_read_the_next_while_one_computes(moe_copied):
    """Experts streamed through the scratch buffer: each chunk's rows are its experts' bytes in ffn.bin, and while
    the caller has one chunk the next is being read into the scratch's other half; a walk left early leaves no
    read landing in the scratch."""
    fd = FlashDir(moe_copied)
    model, _ = load(moe_copied, memory_budget=slots_budget(fd, 1), context=64, prefetch=False)
    engine = model.flash
    try:
        per = engine._fits(REGION)
        assert len(engine._scratch_parts(REGION, per)) == 2  # (halves: a chunk read while one computes)
        layer = next(i for i, regions in enumerate(fd.layers) if regions)
        region = fd.layers[layer][REGION]
        units = np.arange(region.n_units)[::-1][: 2 * per + 1]
        chunks = [units[i : i + per] for i in range(0, len(units), per)]
        assert len(chunks) == 3
        ffn = np.fromfile(moe_copied / "ffn.bin", dtype=np.uint8)
        walk = engine._read_chunks(layer, REGION, chunks)
        for i, (chunk, rows) in enumerate(zip(chunks, walk)):
            assert (engine._scratch_read is not None) == (i + 1 < len(chunks))  # the next chunk under way
            for unit, row in zip(chunk, np.asarray(rows)):
                at = region.unit_offsets([unit])[0]
                assert np.array_equal(row[: region.stride], ffn[at : at + region.stride])
        next(engine._read_chunks(layer, REGION, chunks))  # left after its first chunk, the second being read
        assert engine._scratch_read is not None
        rows = np.asarray(next(engine._read_chunks(layer, REGION, chunks[1:])))  # drains it first
        assert np.array_equal(rows[0][: region.stride], ffn[region.unit_offsets(chunks[1][:1])[0] :][: region.stride])
    finally:
        engine.close()


def test_the_read_ahead_asks_the_next_router_with_its_own_norm(moe_dirs):
    """next_routers' scale turns layer l's expert input RMSNorm(h) * w_l into RMSNorm(h) * w_next: the next router
    sees the input it would get if the residual stream stopped here."""
    _, flash_dir, _ = moe_dirs["qwen3_moe"]
    model, _ = load(flash_dir, context=64, prefetch=True)
    try:
        routers = model.flash.routers
        assert sorted(routers) == list(range(len(model.layers) - 1))
        h = mx.random.normal((3, model.args.hidden_size))
        nxt, scale, gate = routers[0]
        x = model.layers[0].post_attention_layernorm(h)
        want = gate(model.layers[nxt].post_attention_layernorm(h))
        assert mx.allclose(gate(x * scale), want, atol=1e-5).item()
    finally:
        model.flash.close()


def test_the_read_ahead_stops_while_its_guesses_are_wrong(moe_dirs):
    """A routing the next router cannot guess (a replayed one that ignores the router) turns the read-ahead off after
    a few tokens; the guesses go on every PROBE-th forward pass (scored, not read), so it can turn on again."""
    _, flash_dir, _ = moe_dirs["qwen3_moe"]
    fd = FlashDir(flash_dir)
    model, _ = load(flash_dir, memory_budget=slots_budget(fd, 3), context=64, prefetch=True)
    engine, rng = model.flash, np.random.default_rng(0)
    n_experts = fd.layers[0][REGION].n_units
    engine.route = lambda layer, chosen: rng.choice(n_experts, len(chosen), replace=False).astype(chosen.dtype)
    try:
        cache = model.make_cache()
        guessed = []
        for t in range(24):
            mx.eval(model(mx.array([[t + 1]]), cache=cache))
            guessed.append(engine.precision.guessed)
        engine.stats.end()
        ahead = [t.ahead_bytes for t in engine.stats.tokens]
        assert ahead[0] > 0 and not any(ahead[8:]), ahead
        assert not engine.precision.good()
        probes = np.flatnonzero(np.diff(guessed) > 0) + 1  # the passes whose guesses were scored
        assert all(t % experts.PROBE == 0 for t in probes[probes >= 8]) and len(probes[probes >= 8]) == 2
    finally:
        engine.close()


def test_experts_stay_cached_while_they_fit(moe_dirs):
    """Experts default to LRU, not the neurons' window: with room for every expert, one unused for more tokens
    than the window (5) is still cached when its turn comes again, so each expert is read once."""
    _, flash_dir, _ = moe_dirs["mixtral"]
    schedule = [[0, 1]] + [[2, 3]] * 6 + [[0, 1]]
    step = [-1]

    def route(layer, chosen):  # a replayed routing, as benchmarks/moe_decode.py --routing skewed does
        step[0] += layer == 0
        return np.array(schedule[step[0]], dtype=chosen.dtype)

    model, _ = load(flash_dir, context=64, prefetch=False)  # (experts read ahead would be read for nothing)
    model.flash.route = route
    try:
        cache = model.make_cache()
        for t in range(len(schedule)):
            mx.eval(model(mx.array([[t + 1]]), cache=cache))
        model.flash.stats.end()
        assert sum(t.misses for t in model.flash.stats.tokens) == 4 * len(FlashDir(flash_dir).layers)
    finally:
        model.flash.close()


def test_export_is_stock_mlx_lm(moe_gguf_dir, tmp_path):
    """`export` of an MoE directory loads in stock mlx-lm with the flash model's logits; the float routers are
    marked unquantized per module (runtimes that quantize every Linear otherwise expect codes for them)."""
    from mlx_flash.convert.export import export

    from mlx_lm.utils import load as mlx_lm_load

    out = export(moe_gguf_dir, tmp_path / "mlx", progress=False)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["model.layers.0.mlp.gate"] is False and quant["bits"] == 4
    stock, _ = mlx_lm_load(str(out))
    resident, _ = load_resident(moe_gguf_dir)
    cpu_gemv.enabled = False  # MLX's ops on both sides: the same weights give the same bits
    try:
        assert mx.array_equal(stock(PROMPT[None]), resident(PROMPT[None]))
    finally:
        cpu_gemv.enabled = True


def test_moe_refuses_what_does_not_apply(moe_dirs, tmp_path):
    """Neuron sparsity and dense-only conversion options are refused with a clear error; nothing is written."""
    src_dir, flash_dir, _ = moe_dirs["olmoe"]
    with pytest.raises(FlashError, match="router"):
        load(flash_dir, sparsity="dip")
    with pytest.raises(FlashError, match="--bits"):
        convert(str(src_dir), tmp_path / "x", bits=8, progress=False)
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def moe_gguf_dir(tmp_path_factory):
    """A qwen3moe GGUF of 340 MB (8 layers of 96 experts, top-8), converted: large enough that 25% of it is
    mostly expert slots, not the fixed buffers."""
    from mlx_flash.tools.synthetic_gguf import write_gguf

    root = tmp_path_factory.mktemp("moe-gguf")
    gguf = write_gguf(
        "moe-small",
        root / "m.gguf",
        progress=False,
        num_hidden_layers=8,
        vocab_size=2048,
        num_experts=96,
        hidden_size=512,
        moe_intermediate_size=512,
        num_attention_heads=4,
        head_dim=128,
        num_key_value_heads=2,
    )
    return convert(str(gguf), root / "flash", progress=False)


def test_percent_budgets_equal_resident(moe_gguf_dir, float_activations):
    """At 25%, 50% and 100% of the model's bytes, greedy tokens equal the resident model's and logits agree to
    float rounding; the smaller budgets hold fewer expert slots and read more."""
    resident, _ = load_resident(moe_gguf_dir, dtype=mx.float32)
    ref_tokens, ref_logits = greedy(resident), resident(PROMPT[None])
    slots, reads = [], []
    for budget in ("25%", "50%", "100%"):
        model, _ = load(moe_gguf_dir, memory_budget=budget, context=64)
        try:
            assert greedy(model) == ref_tokens, budget
            assert mx.abs(model(PROMPT[None]) - ref_logits).max().item() < 1e-4, budget
            model.flash.stats.end()
            slots.append(model.flash.plan.capacity[0][REGION])
            reads.append(model.flash.stats.device_bytes())
        finally:
            model.flash.close()
    assert 0 < slots[0] < slots[1] < slots[2] and reads[0] > reads[1] > reads[2], (slots, reads)


def test_generate_holds_its_budget_under_a_hard_cap(moe_gguf_dir, generate_capped):
    """`generate --memory-budget 25% --stats` on an MoE directory under a cgroup limit of the budget + the
    interpreter's baseline: it finishes, and its peak RSS above that baseline is inside the budget."""
    from mlx_flash.budget import parse_size

    r, peak = generate_capped(moe_gguf_dir, "25%", "--max-tokens", "8", "--ignore-chat-template")
    assert r.ok, r.summary() + "\n" + r.stderr
    assert peak, r.stdout
    assert 0 < peak <= parse_size("25%", FlashDir(moe_gguf_dir).model_bytes), r.stdout
    assert "router (the model's own top-k: exact)" in r.stdout and "hit " in r.stdout


def test_a_failed_read_leaves_no_unread_expert_cached(moe_dirs):
    """A read that fails mid-layer raises ReadError to the caller; that layer's cache forgets what it admitted for
    the pass (rows that may never have been filled) and the read-ahead in flight is dropped, so decoding afterwards
    gives the same tokens as before."""
    from mlx_flash.errors import ReadError

    _, flash_dir, _ = moe_dirs["qwen3_moe"]
    fd = FlashDir(flash_dir)
    model, _ = load(flash_dir, memory_budget=slots_budget(fd, 3), context=64, prefetch=True)
    engine = model.flash
    try:
        want = greedy(model)
        engine.reset()
        real, calls, failed = engine.reader.wait, [0], []

        def wait(handle):
            real(handle)
            calls[0] += 1
            if calls[0] == 3:
                failed.append([c[REGION].num_used if c else 0 for c in engine.caches])
                raise ReadError("injected")

        engine.reader.wait = wait
        with pytest.raises(ReadError, match="injected"):
            greedy(model)
        engine.reader.wait = real
        emptied = [i for i, c in enumerate(engine.caches) if c and c[REGION].num_used == 0 and failed[0][i] > 0]
        assert len(emptied) == 1 and not engine.read_ahead.pending
        assert greedy(model) == want
    finally:
        engine.close()


@pytest.fixture(scope="module")
def wide_vocab_dirs(tmp_path_factory):
    """arch -> (4-bit mlx-lm source, its flash dir) of tiny MoE models with a 131072-token vocabulary: embeddings and
    head big enough that streaming them saves more than its buffers cost, so there are budgets under the floor."""
    from mlx_lm.utils import quantize_model, save_model

    root = tmp_path_factory.mktemp("moe-vocab")
    out = {}
    for arch in ("qwen3_moe", "mixtral"):
        model, config = load_source_model(
            make_tiny_model_dir(arch, root / f"{arch}-float", vocab_size=131072, tie_word_embeddings=False), lazy=False
        )
        model, config = quantize_model(model, config, group_size=32, bits=4)
        q = root / f"{arch}-q4"
        save_model(q, model)
        (q / "config.json").write_text(json.dumps(config))
        copy_tokenizer(root / f"{arch}-float", q)
        out[arch] = (q, convert(str(q), root / f"{arch}-flash", progress=False))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_below_the_resident_floor_attention_and_head_stream(wide_vocab_dirs, arch, float_activations):
    """A budget under the resident floor streams attention layers and the embedding / LM head from flash, as for
    dense models (the native decode step binds them as they load, mixtral runs MLX's forward): tokens and logits
    are still stock mlx-lm's, and the streamed bytes are counted."""
    from mlx_flash.budget import min_streaming_budget
    from mlx_flash.engine.resident import stream_groups
    from mlx_flash.loader import cpu_cast
    from mlx_flash.models.inspect import instantiate

    src_dir, flash_dir = wide_vocab_dirs[arch]
    src, _ = load_source_model(src_dir, lazy=False)
    fd = FlashDir(flash_dir)
    resident = fd.resident_nbytes(cpu_cast)
    lowest = min_streaming_budget(
        fd, 64, kv_size_of(fd), resident=resident, groups=stream_groups(fd, instantiate(fd.config), cpu_cast, 64)
    )
    budget = lowest + len(fd.layers) * fd.layouts[REGION].stride  # one expert slot a layer
    assert budget < min_budget(fd, 64, kv_size_of(fd), resident=resident)
    model, _ = load(flash_dir, memory_budget=budget, context=64)
    try:
        kinds = {g.kind for g in model.flash.plan.streamed}
        assert "head" in kinds and ("layer" in kinds or arch != "qwen3_moe"), kinds  # (mixtral's attention fits back)
        assert model.forward.native == (arch == "qwen3_moe" and cpu_gemv.available()), model.forward.why
        assert greedy(model) == greedy(src)
        assert mx.abs(model(PROMPT[None]) - src(PROMPT[None])).max().item() < 1e-4
        model.flash.stats.end()
        assert sum(t.streamed_bytes for t in model.flash.stats.tokens) > 0
    finally:
        model.flash.close()
