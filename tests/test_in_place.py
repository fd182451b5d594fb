"""Experts read in place from the source's safetensors (format v5): nothing of them written, the same bits as a
copied directory at every budget, and a source moved, cut or changed refused with a typed error naming it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mlx_flash.convert import convert
from mlx_flash.engine.experts import REGION
from mlx_flash.errors import ChecksumError, FlashFormatError, SourceFileError
from mlx_flash.format.directory import FFN, MANIFEST, RESIDENT, FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import load
from mlx_flash.tools.synthetic import tiny_quantized

import mlx.core as mx
import numpy as np
import pytest
from test_moe import slots_budget

PROMPT = mx.array([1, 5, 9, 33, 70, 2, 11])


@pytest.fixture(scope="module", params=["windows", "exact"])
def pair(request, tmp_path_factory):
    """(a 4-bit mlx-community-style qwen3_moe source, its flash directory in place, the same converted with copy).
    "windows": experts whose components' strides are multiples of the alignment, each read as the aligned window
    around it straight into its row (the components at odd bytes, as the file has them); "exact": strides that are
    not, each component read as it is (bounced)."""
    root = tmp_path_factory.mktemp("in_place")
    windows = request.param == "windows"
    shape = dict(hidden_size=128, moe_intermediate_size=64) if windows else {}
    src = tiny_quantized("qwen3_moe", root / "src", **shape)
    if windows:  # tensors at odd bytes, as mx.save_safetensors leaves them (its header is not padded)
        (f,) = src.glob("*.safetensors")
        arrays = mx.load(str(f))
        for pad in range(8):
            mx.save_safetensors(str(f), arrays, metadata={"format": "mlx", "pad": "x" * pad})
            if read_header_bytes(f) % 4 == 1:
                break
        assert read_header_bytes(f) % 4 == 1
    alignment = 512 if windows else None
    in_place = convert(str(src), root / "in_place", progress=False, alignment=alignment)
    fd = FlashDir(in_place)
    extents = [e for layer in fd.layers for r in layer.values() for e in r.extents]
    assert extents and all((e.offset % 512 == 0 and e.nbytes % 512 == 0) == windows for e in extents)
    assert any(e.at % 2 for e in extents) == windows  # (components at odd bytes of their rows)
    return src, in_place, convert(str(src), root / "copied", progress=False, copy=True, alignment=alignment)


def read_header_bytes(path) -> int:
    """Where a safetensors file's data start."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def decode(flash_dir, budget_slots, n=10):
    """Greedy tokens and their log-probabilities under a budget of `budget_slots` expert slots a layer (None: all)."""
    fd = FlashDir(flash_dir)
    budget = None if budget_slots is None else slots_budget(fd, budget_slots)
    model, _ = load(flash_dir, memory_budget=budget, context=64)
    try:
        out = [(int(t), np.array(lp)) for t, lp in generate_step(PROMPT, model, max_tokens=n)]
        return [t for t, _ in out], np.stack([lp for _, lp in out])
    finally:
        model.flash.close()


def test_nothing_of_the_experts_is_written(pair):
    """The in-place directory holds the resident weights and small files only; its units' components are the copy's,
    byte for byte (so the engines see the same units)."""
    src, in_place, copied = pair
    fd, ref = FlashDir(in_place), FlashDir(copied)
    assert fd.version == 5 and fd.sources is not None and not (in_place / FFN).exists()
    assert ref.sources is None and ref.ffn_bytes > 0
    others = sum(f.stat().st_size for f in in_place.iterdir() if f.name != RESIDENT)
    assert others < 64 << 10  # manifest, config, tokenizer, unit checksums
    assert fd.resident_bytes == ref.resident_bytes
    for i, layer in enumerate(fd.layers):
        if layer:
            rows, ref_rows = fd.read_region(i, REGION), ref.read_region(i, REGION)
            for c, r in zip(fd.layout_of(i, REGION).components, ref.layouts[REGION].components):
                assert c.name == r.name and c.nbytes == r.nbytes
                assert np.array_equal(
                    rows[:, c.offset : c.offset + c.nbytes], ref_rows[:, r.offset : r.offset + r.nbytes]
                )
    fd.verify()


@pytest.mark.parametrize("slots", [None, 1, 3])
def test_same_tokens_and_log_probabilities_as_the_copy(pair, slots):
    """Greedy tokens and every log-probability equal the copied directory's at every budget (exactly: the rows are
    the same bytes)."""
    _, in_place, copied = pair
    tokens, logprobs = decode(in_place, slots)
    ref_tokens, ref_logprobs = decode(copied, slots)
    assert tokens == ref_tokens
    assert np.array_equal(logprobs, ref_logprobs)


def _moved(src, in_place, tmp_path):
    """A copy of the in-place directory and its source, for tests that break the source."""
    s, d = tmp_path / "src", tmp_path / "flash"
    shutil.copytree(src, s, copy_function=shutil.copy2)  # (mtimes kept)
    shutil.copytree(in_place, d)
    manifest = (d / "flash.json").read_text().replace(str(src.resolve()), str(s.resolve()))
    (d / "flash.json").write_text(manifest)
    FlashDir(d)  # opens as it is
    shard = next(s.glob("*.safetensors"))
    return s, d, shard


def test_a_moved_or_cut_source_is_refused_naming_it(pair, tmp_path):
    src, in_place, _ = pair
    s, d, shard = _moved(src, in_place, tmp_path)
    shard.rename(shard.with_suffix(".moved"))
    with pytest.raises(SourceFileError, match=f"{shard}: missing"):
        FlashDir(d)
    shard.with_suffix(".moved").rename(shard)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    with pytest.raises(SourceFileError, match=f"{shard}: changed since .* bytes"):
        FlashDir(d)


def test_a_source_replaced_by_another_of_the_same_size_is_refused(pair, tmp_path):
    """Modified (a new mtime): refused at open; the same size and mtime but other bytes (a copy that kept the time):
    verify and an expert's first read fail its checksum, naming the source."""
    src, in_place, _ = pair
    s, d, shard = _moved(src, in_place, tmp_path)
    fd = FlashDir(d)
    layer = next(i for i, layer in enumerate(fd.layers) if layer)
    e = fd.layers[layer][REGION].extents[0]  # expert 0's first component
    path = fd.unit_paths[e.file]
    st = path.stat()
    data = bytearray(path.read_bytes())
    at = e.offset + e.at  # (the component, not the window's bytes around it)
    data[at : at + 16] = bytes(x ^ 0xFF for x in data[at : at + 16])
    path.write_bytes(bytes(data))
    with pytest.raises(SourceFileError, match="modified"):
        FlashDir(d)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    fd = FlashDir(d)
    with pytest.raises(FlashFormatError, match=f"source files in {s.resolve()}: checksum mismatch in layer {layer}"):
        fd.verify()
    model, _ = load(d, memory_budget=slots_budget(fd, 1), context=64)
    try:
        with pytest.raises(ChecksumError, match=f"source files in {s.resolve()}: checksum mismatch in layer {layer}"):
            model.flash.read_into_slots(layer, REGION, np.array([0]), np.array([0]))()
    finally:
        model.flash.close()


def test_commands_say_one_line_for_a_moved_source(pair, tmp_path):
    src, in_place, _ = pair
    s, d, shard = _moved(src, in_place, tmp_path)
    ok = subprocess.run(
        [sys.executable, "-m", "mlx_flash.generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "3"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    shutil.rmtree(s)
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "3"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{shard}: missing" in r.stderr and "convert the model again" in r.stderr


def _generate(model, env):
    cmd = [sys.executable, "-m", "mlx_flash.generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "4"]
    cmd += ["--temp", "0", "--ignore-chat-template"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def test_generate_takes_the_source_itself(pair, tmp_path):
    """`generate --model` given an mlx-lm directory or a GGUF converts it once into the cache directory (the MoE's
    experts in place) and generates what the converted directory does; the second run converts nothing."""
    from mlx_flash.tools.synthetic_gguf import write_gguf

    src, in_place, _ = pair
    gguf = write_gguf("moe-small", tmp_path / "tiny-moe.gguf", progress=False, num_hidden_layers=2, vocab_size=512,
                      num_experts=8, hidden_size=64, moe_intermediate_size=32, num_attention_heads=2, head_dim=32,
                      num_key_value_heads=1)  # fmt: skip
    env = dict(os.environ, MLX_FLASH_CACHE=str(tmp_path / "cache"))
    for model, ref in ((src, in_place), (gguf, None)):
        first = _generate(model, env)
        assert first.returncode == 0 and "converting" in first.stderr, first.stderr[-2000:]
        again = _generate(model, env)
        assert again.returncode == 0 and "converting" not in again.stderr
        assert again.stdout.split("==========")[0] == first.stdout.split("==========")[0]
        if ref is not None:
            assert _generate(ref, env).stdout.split("==========")[0] == first.stdout.split("==========")[0]
    converted = {
        d.name.split("-")[0]: FlashDir(d).sources is not None for d in (tmp_path / "cache" / "converted").iterdir()
    }
    assert converted == {src.name: True, "tiny": True}  # (the GGUF's experts read in place, as its blocks)


def test_convert_in_place_needs_the_resident_weights_once_on_disk(tmp_path, monkeypatch):
    """Converted onto a filesystem of 1.05 times the resident file (and the small files' blocks), an MoE read in place
    converts: nothing of the experts is written and the resident weights are on disk once (the space check off, so
    the filesystem bounds the peak)."""
    from mlx_flash.convert import build

    from test_convert_input import tmpfs

    src = tiny_quantized("qwen3_moe", tmp_path / "src", vocab_size=8192, hidden_size=128, moe_intermediate_size=64)
    ref = FlashDir(convert(str(src), tmp_path / "ref", progress=False))
    small = sum(-(-f.stat().st_size // 4096) * 4096 for f in ref.path.iterdir() if f.name != RESIDENT)
    monkeypatch.setattr(build, "check_free_space", lambda out, needed: None)
    with tmpfs(tmp_path / "disk", int(1.05 * ref.resident_bytes) + small + (16 << 10)) as disk:
        assert ref.resident_bytes > 50 * small  # (the bound is the resident file's)
        out = FlashDir(build.convert(str(src), disk / "out", progress=False))
        assert out.sources is not None and out.resident_bytes == ref.resident_bytes


@pytest.mark.parametrize("copy", [False, True], ids=["in_place", "copy"])
def test_a_moe_gguf_converts_on_a_disk_of_what_it_writes_and_a_twentieth(tmp_path, monkeypatch, copy):
    """A Q4_0 qwen3moe GGUF of 48 layers converts on a filesystem of 1.05 times what it writes (the space check off):
    in place, its resident file (and the small files' blocks); with --copy, the whole directory. Its mlx-lm
    directory, a shard per layer without the biases Q4_0 implies and its experts a shard apart, is freed as the
    output is written, which is written once."""
    from mlx_flash.convert import build
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    from test_convert_input import tmpfs

    shape = dict(num_hidden_layers=48, hidden_size=512, num_attention_heads=8)  # (the 30B's 48 layers)
    src = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, **{**tiny_moe("qwen3_moe"), **shape})
    ref = FlashDir(convert(str(src), tmp_path / "ref", progress=False, copy=copy))
    blocks = {f.name: -(-f.stat().st_size // 4096) * 4096 for f in ref.path.iterdir()}
    written = (RESIDENT, FFN) if copy else (RESIDENT,)  # (what the bound is a twentieth of)
    big, small = (sum(v for k, v in blocks.items() if (k in written) == b) for b in (True, False))
    monkeypatch.setattr(build, "check_free_space", lambda out, needed: None)
    needed = build._disk_needed(src, None, "auto", 64, False, None, "neurons", None, not copy)
    assert big + small < needed < 1.3 * (big + small), needed / (big + small)  # (the check's estimate: an upper bound)
    with tmpfs(tmp_path / "disk", int(1.05 * big) + small + (16 << 10)) as disk:
        assert big > 10 * small and ref.symmetric and (FFN in blocks) == copy
        out = FlashDir(build.convert(str(src), disk / "out", progress=False, copy=copy))
        for name in set(blocks) - {MANIFEST}:  # (which records ffn.bin's time)
            assert (out.path / name).read_bytes() == (ref.path / name).read_bytes(), name


@pytest.fixture(scope="module", params=["Q4_K_M", "Q2_K", "IQ4_XS"])
def k_quants(tmp_path_factory, request):
    """(a qwen3moe GGUF as llama-quantize mixes its types: Q4_K_M's Q4_K experts with Q6_K down projections in its
    use_more_bits layers, Q2_K's Q2_K experts with Q3_K down projections, or IQ4_XS's; its flash directory)."""
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    root = tmp_path_factory.mktemp("k_quants")
    shape = dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4)
    gguf = write_gguf(
        "moe-small", root / "m.gguf", progress=False, gguf_type=request.param, **{**tiny_moe("qwen3_moe"), **shape}
    )
    return gguf, convert(str(gguf), root / "flash", progress=False)


def test_k_quant_experts_are_the_files_blocks_read_in_place(k_quants):
    """Nothing of the experts is written: each expert's rows are the GGUF's bytes of that expert (its type's in each
    layer), read as the 512-byte windows around them; dequantised, they are gguf's values bit for bit."""
    from mlx_flash.convert.gguf import read_header

    import gguf as gguf_package

    gguf, flash = k_quants
    fd = FlashDir(flash)
    assert fd.sources is not None and not (flash / FFN).exists()
    tensors = {t.name: t for t in read_header(gguf).tensors}
    for p in ("gate", "up", "down"):  # each layer's type of each matrix, one where every layer has the same
        kinds = {str(i): tensors[f"blk.{i}.ffn_{p}_exps.weight"].tensor_type.name for i in range(4)}
        want = kinds if len(set(kinds.values())) > 1 else kinds["0"]
        assert fd.ffn["quantization"][f"{p}_proj"] == {"ggml": want, "values": 256}
        assert len(set(kinds.values())) == (2 if p == "down" and "Q4_K" in kinds.values() else 1)  # (Q4_K_M's mix)
    for i, layer in enumerate(fd.layers):
        rows = fd.read_region(i, REGION)
        arrays = fd.unpack_layer(i)
        for c, p in zip(fd.layout_of(i, REGION).components, ("gate", "up", "down")):
            t = tensors[f"blk.{i}.ffn_{p}_exps.weight"]
            raw = np.asarray(t.data).reshape(8, -1)
            assert np.array_equal(rows[:, c.offset : c.offset + c.nbytes], raw)  # the file's bytes
            w = arrays[f"{p}_proj.weight"]  # (as mlx-lm's modules hold them: affine codes, or float32)
            if f"{p}_proj.scales" in arrays:
                w = mx.dequantize(w, arrays[f"{p}_proj.scales"], arrays[f"{p}_proj.biases"], 32, 4)
            ref = gguf_package.quants.dequantize(raw, t.tensor_type).reshape(w.shape)
            assert np.array_equal(np.array(w).view(np.uint32), ref.view(np.uint32))
        assert all(e.nbytes - e.length < 1024 for e in layer[REGION].extents)  # (a read adds its window's ends)
    fd.verify()


@pytest.mark.parametrize("ops", ["native", "mlx"])
def test_k_quant_experts_give_the_same_bits_at_every_budget(k_quants, ops, monkeypatch):
    """Greedy tokens and log-probabilities equal at every budget on either path; MLX's equal mlx-lm's model on the
    same weights (load_resident) bit for bit, the native kernels' it within their int8 activations' rounding."""
    from mlx_flash.compute import cpu_gemv

    if ops == "native" and not cpu_gemv.available():
        pytest.skip("the native CPU kernels do not run here")
    monkeypatch.setattr(cpu_gemv, "enabled", ops == "native")
    same_bits_at_every_budget(k_quants[1], (None, 1, 3), ops)


def same_bits_at_every_budget(flash, slots, ops: str):
    """Greedy tokens and log-probabilities equal under each budget of `slots` expert slots a layer; the logits of
    MLX's ops (ops "mlx") equal mlx-lm's model on the same weights (load_resident) bit for bit, the native kernels'
    within their int8 activations' rounding."""
    from mlx_flash.loader import load_resident

    runs = [decode(flash, s) for s in slots]
    for tokens, logprobs in runs[1:]:
        assert tokens == runs[0][0] and np.array_equal(logprobs, runs[0][1])
    resident, _ = load_resident(flash, dtype=mx.float32)
    model, _ = load(flash, context=64)
    try:
        assert model.forward.native == (ops == "native")
        ours, ref = model(PROMPT[None]), resident(PROMPT[None])
    finally:
        model.flash.close()
    if ops == "mlx":
        assert mx.array_equal(ours, ref)
    else:
        assert np.abs(np.array(ours - ref)).max() < 0.05 * np.abs(np.array(ref)).max()


@pytest.mark.parametrize("ops", ["native", "mlx"])
def test_resident_blocks_streamed_give_the_same_bits(k_quants, ops, monkeypatch):
    """The resident matrices kept as the file's GGML blocks (attention, LM head, token embedding) all streamed from
    flash (the planner made to stream every group: in a model this small their read buffers take more than they
    free): the greedy tokens and log-probabilities of the whole model resident, on either path (the native step's
    attention and head on handles of the streamed blocks)."""
    from mlx_flash import budget
    from mlx_flash.compute import cpu_gemv

    if ops == "native" and not cpu_gemv.available():
        pytest.skip("the native CPU kernels do not run here")
    monkeypatch.setattr(cpu_gemv, "enabled", ops == "native")
    _, flash = k_quants
    fd = FlashDir(flash)
    assert {"lm_head", "model.embed_tokens"} <= set(fd.blocks)
    want = decode(flash, None)
    choose = budget.choose_streamed
    monkeypatch.setattr(budget, "choose_streamed", lambda groups, *a, **k: choose(groups, *a, always=groups))
    model, _ = load(flash, memory_budget=1 << 30, context=64)
    try:
        assert {g.kind for g in model.flash.plan.streamed} == {"rows", "layer", "head"}
        assert model.forward.native == (ops == "native")
        out = [(int(t), np.array(lp)) for t, lp in generate_step(PROMPT, model, max_tokens=10)]
    finally:
        model.flash.close()
    assert [t for t, _ in out] == want[0] and np.array_equal(np.stack([lp for _, lp in out]), want[1])


@pytest.mark.parametrize("ops", ["native", "mlx"])
def test_a_copied_gguf_is_its_blocks_with_the_bits_in_place_gives(k_quants, ops, monkeypatch, tmp_path):
    """convert --copy of a GGUF writes its expert tensors as they are into ffn.bin (no more bytes than the GGUF's,
    but alignment) and reads them from there as in place: the same rows, so the same greedy tokens and
    log-probabilities as in place at every budget, on either path. The directory is whole: copied elsewhere (new
    file times), it opens and verifies."""
    from mlx_flash.compute import cpu_gemv
    from mlx_flash.convert.gguf import read_header

    if ops == "native" and not cpu_gemv.available():
        pytest.skip("the native CPU kernels do not run here")
    monkeypatch.setattr(cpu_gemv, "enabled", ops == "native")
    gguf, flash = k_quants
    copied = convert(str(gguf), tmp_path / "copied", progress=False, copy=True)
    copied = Path(shutil.copytree(copied, tmp_path / "moved", copy_function=shutil.copy))  # (new mtimes)
    fd, ref = FlashDir(copied), FlashDir(flash)
    exps = [t for t in read_header(gguf).tensors if t.name.endswith("_exps.weight")]
    assert 0 <= fd.ffn_path.stat().st_size - sum(t.n_bytes for t in exps) < len(exps) * fd.alignment
    fd.verify()
    for i, layer in enumerate(fd.layers):
        if layer:
            rows, ref_rows = fd.read_region(i, REGION), ref.read_region(i, REGION)
            for c, r in zip(fd.layout_of(i, REGION).components, ref.layout_of(i, REGION).components):
                assert c.nbytes == r.nbytes
                assert np.array_equal(
                    rows[:, c.offset : c.offset + c.nbytes], ref_rows[:, r.offset : r.offset + r.nbytes]
                )
    for slots in (None, 1):
        tokens, logprobs = decode(copied, slots)
        ref_tokens, ref_logprobs = decode(flash, slots)
        assert tokens == ref_tokens and np.array_equal(logprobs, ref_logprobs)


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q8_0", "Q4_K_M", "Q6_K", "Q2_K", "Q3_K_M", "IQ4_XS"])
def test_a_call_takes_what_the_plan_counts(tmp_path, gguf_type):
    """MLX's ops over experts of GGML blocks (repacked for MLX's quantised products, or dequantised) take at most
    FlashDir.call_bytes a unit at their peak, the share of the workspace gathered_units gives each unit of a call
    (ggml.TEMPORARY_BYTES), and most of it in the layers of the largest types."""
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    import mlx.nn as nn

    shape = dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4)
    extra = {**tiny_moe("qwen3_moe"), **shape}
    gguf = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, gguf_type=gguf_type, **extra)
    fd = FlashDir(convert(str(gguf), tmp_path / "flash", progress=False))
    model, _ = load(fd.path, memory_budget=slots_budget(fd, 1), context=64)
    units, stride = 8, fd.layouts[REGION].stride
    rows = mx.array(np.random.default_rng(0).integers(0, 256, (units, stride), dtype=np.uint8))
    x = mx.random.normal((units, 256))
    peaks = []
    try:
        for layer in range(4):
            mx.eval(rows, x)
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            y = model.flash._switch(
                layer, x, rows, mx.arange(units), np.arange(units, dtype=np.uint32), lambda u, g: nn.silu(g) * u
            )
            mx.eval(y)
            peaks.append(mx.get_peak_memory() - base)
            del y
    finally:
        model.flash.close()
    assert max(peaks) <= units * fd.call_bytes(REGION), (peaks, fd.call_bytes(REGION))
    # (MLX frees some temporaries before it makes the next when its worker keeps pace with the dispatch: a loaded
    # machine's peak was 0.59 of the count where an idle one's is 0.7-0.9)
    assert max(peaks) >= 0.5 * units * fd.call_bytes(REGION), (peaks, fd.call_bytes(REGION))
