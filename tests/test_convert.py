"""Converter and flash format v1: bit-exact bundles, resident-only logits, clear errors."""

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys

from mlx_flash import FlashError, FlashFormatError, SourceError, UnsupportedArchitectureError
from mlx_flash.convert import convert
from mlx_flash.convert.source import load_source_model
from mlx_flash.format.directory import FlashDir, FlashWriter
from mlx_flash.loader import load_resident
from mlx_flash.models.architectures import ADAPTERS
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "opt"]
TOKENS = mx.array([[1, 5, 9, 33, 7, 100, 3, 42]])


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model_dir(arch, root / arch) for arch in ARCHS}


def _check_bundles(fd, model, col_quant):
    adapter = ADAPTERS[fd.architecture]
    for i in range(len(fd.layers)):
        rows = fd.unpack_layer(i)
        linears = adapter.linears(model.layers[i].mlp)  # canonical rows straight from the source modules
        for name in adapter.row_matrices:
            for key in ("weight", "scales", "biases"):
                if key in linears[name]:
                    assert np.array_equal(np.array(rows[f"{name}.{key}"]), np.array(linears[name][key])), (i, name, key)
        col = linears[adapter.col_matrix]
        if "scales" in col:
            dense = mx.dequantize(col["weight"], col["scales"], col["biases"], col.group_size, col.bits)
        else:
            dense = col["weight"]
        if col_quant is None:
            assert np.array_equal(np.array(rows[f"{adapter.col_matrix}.weight"]), np.array(dense.T))
        else:
            w, s, b = mx.quantize(dense.T, col_quant["group_size"], col_quant["bits"])
            for key, ref in (("weight", w), ("scales", s), ("biases", b)):
                assert np.array_equal(np.array(rows[f"{adapter.col_matrix}.{key}"]), np.array(ref))


@pytest.mark.parametrize("arch", ARCHS)
def test_float_bundles_bit_exact_and_logits_match(arch, tiny_dirs, tmp_path):
    out = convert(str(tiny_dirs[arch]), tmp_path / "flash", progress=False)
    fd = FlashDir(out)
    src, _ = load_source_model(tiny_dirs[arch], lazy=False)
    _check_bundles(fd, src, None)
    for r in fd.regions():
        assert r.offset % fd.alignment == 0 and r.stride % fd.unit_alignment == 0 and fd.unit_alignment == 16
    model, _ = load_resident(out)
    diff = mx.abs(model(TOKENS) - src(TOKENS)).max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize(
    "layout,expected",
    [("neurons", {"bits": 4, "group_size": 32, "resident_scales": True}), ("dip", {"bits": 8, "group_size": 32})],
)
def test_default_down_rows(tiny_dirs, tmp_path, layout, expected):
    """By default down keeps the model's own 4-bit codes (neurons layout); where that cannot be (dip), 8 bits."""
    fd = FlashDir(
        convert(str(tiny_dirs["llama"]), tmp_path / "q", bits=4, group_size=32, layout=layout, progress=False)
    )
    assert fd.ffn["matrices"]["down"]["quantization"] == expected


@pytest.mark.parametrize("arch", ["llama", "phi3", "opt"])
def test_quantised_bundles(arch, tiny_dirs, tmp_path):
    """--bits 4 --down-bits 8 on a float source: every row matrix and the transposed down/fc2 quantised once, per
    neuron."""
    fd = FlashDir(convert(str(tiny_dirs[arch]), tmp_path / "q", bits=4, group_size=32, down_bits="8", progress=False))
    assert fd.manifest["quantization"] == {"bits": 4, "group_size": 32}
    adapter = ADAPTERS[arch]
    assert fd.ffn["matrices"][adapter.col_matrix] == {
        "quantization": {"bits": 8, "group_size": 32},
        "transposed": True,
        "region": "neurons",
    }
    src, _ = load_source_model(tiny_dirs[arch], lazy=False)
    for i in range(len(fd.layers)):
        rows = fd.unpack_layer(i)
        linears = adapter.linears(src.layers[i].mlp)
        for name in adapter.matrices:
            w = linears[name]["weight"]
            col = name == adapter.col_matrix
            expected = mx.quantize(w.T if col else w, 32, 8 if col else 4)
            for key, ref in zip(("weight", "scales", "biases"), expected):
                assert np.array_equal(np.array(rows[f"{name}.{key}"]), np.array(ref)), (i, name, key)
    # Resident weights are exactly what mlx-lm's own quantisation gives.
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    ref, _ = quantize_model(src, {}, group_size=32, bits=4)
    ref = dict(tree_flatten(ref.parameters()))
    resident = fd.load_resident()
    for key, value in resident.items():
        if ".mlp." not in key:
            assert np.array_equal(np.array(value), np.array(ref[key])), key
    model, _ = load_resident(fd.path)
    assert model(TOKENS).shape == (1, TOKENS.shape[1], 256)


@pytest.mark.parametrize("bits", [None, 4])
def test_dip_layout(bits, tiny_dirs, tmp_path):
    """dip layout: gate/up stored by input column, down by neuron; same model either way."""
    src, _ = load_source_model(tiny_dirs["llama"], lazy=False)
    fd = FlashDir(
        convert(str(tiny_dirs["llama"]), tmp_path / "dip", layout="dip", bits=bits, group_size=32, progress=False)
    )
    assert set(fd.layouts) == {"inputs", "neurons"}
    hidden, n = fd.ffn["hidden_size"], fd.ffn["intermediate_size"]
    assert [fd.layers[0][r].n_units for r in ("inputs", "neurons")] == [hidden, n]
    for i in range(len(fd.layers)):
        arrays = fd.unpack_layer(i)
        linears = ADAPTERS["llama"].linears(src.layers[i].mlp)
        for name in ("gate", "up", "down"):
            w = linears[name]["weight"].T
            if bits is None:
                assert np.array_equal(np.array(arrays[f"{name}.weight"]), np.array(w))
            else:
                for key, ref in zip(("weight", "scales", "biases"), mx.quantize(w, 32, 8 if name == "down" else 4)):
                    assert np.array_equal(np.array(arrays[f"{name}.{key}"]), np.array(ref)), (i, name, key)
    if bits is None:
        model, _ = load_resident(fd.path)
        assert mx.abs(model(TOKENS) - src(TOKENS)).max().item() < 1e-4


def test_dip_layout_needs_glu(tiny_dirs, tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match="layout 'dip'"):
        convert(str(tiny_dirs["opt"]), tmp_path / "x", layout="dip", progress=False)


@pytest.mark.usefixtures("float_activations")  # against the source's float arithmetic
def test_quantised_source_keeps_rows_and_requantises_down(tiny_dirs, tmp_path):
    """A quantised mlx-lm source: gate/up rows stored bit-exactly, down re-quantised along d_model when asked."""
    from mlx_lm.utils import quantize_model, save_model

    src, config = load_source_model(tiny_dirs["llama"], lazy=False)
    qdir = tmp_path / "qsrc"
    src, config = quantize_model(src, config, group_size=32, bits=4)
    save_model(qdir, src)
    (qdir / "config.json").write_text(json.dumps(config))
    src, _ = load_source_model(qdir, lazy=False)

    fd = FlashDir(convert(str(qdir), tmp_path / "a", down_bits="8", progress=False))
    _check_bundles(fd, src, {"bits": 8, "group_size": 32})
    fd = FlashDir(convert(str(qdir), tmp_path / "a4", down_bits="4", progress=False))
    _check_bundles(fd, src, {"bits": 4, "group_size": 32})
    exact = FlashDir(convert(str(qdir), tmp_path / "b", down_bits="float", progress=False))
    _check_bundles(exact, src, None)
    assert exact.ffn["matrices"]["down"]["quantization"] is None
    model, _ = load_resident(exact.path)
    assert mx.abs(model(TOKENS) - src(TOKENS)).max().item() < 1e-3


def test_cli_default_quantises_float_sources(tiny_dirs, tmp_path):
    """With neither --dtype nor --bits a float source becomes 8-bit (and says so); --dtype keeps floats."""
    run = [sys.executable, "-m", "mlx_flash.convert", "--model", str(tiny_dirs["qwen3"]), "--out"]
    r = subprocess.run(run + [str(tmp_path / "auto")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "float source (float32): quantising to 8-bit, group size 64" in r.stdout
    assert FlashDir(tmp_path / "auto").manifest["quantization"] == {"bits": 8, "group_size": 64}
    r = subprocess.run(run + [str(tmp_path / "f16"), "--dtype", "float16"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fd = FlashDir(tmp_path / "f16")
    assert fd.manifest["quantization"] is None and fd.manifest["dtype"] == "float16"


@pytest.fixture
def flash(tiny_dirs, tmp_path):
    return convert(str(tiny_dirs["llama"]), tmp_path / "flash", progress=False)


def _verify_cli(path):
    r = subprocess.run([sys.executable, "-m", "mlx_flash.verify", str(path)], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def test_verify_ok(flash):
    code, out = _verify_cli(flash)
    assert code == 0 and "checksums match" in out


def test_truncated_ffn(flash):
    size = (flash / "ffn.bin").stat().st_size
    os.truncate(flash / "ffn.bin", size - 100)
    with pytest.raises(FlashFormatError, match=r"truncated: layer 1"):
        FlashDir(flash)
    code, out = _verify_cli(flash)
    assert code == 1 and "truncated" in out and "Traceback" not in out


def test_flipped_byte_names_layer(flash):
    fd = FlashDir(flash)
    with open(flash / "ffn.bin", "r+b") as f:
        f.seek(fd.layers[1]["neurons"].offset + 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FlashFormatError, match="checksum mismatch in layer 1"):
        FlashDir(flash).verify()
    code, out = _verify_cli(flash)
    assert code == 1 and "layer 1" in out


def test_flipped_resident_byte(flash):
    with open(flash / "resident.safetensors", "r+b") as f:
        f.seek(-5, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(FlashFormatError, match="resident.safetensors: checksum mismatch"):
        FlashDir(flash).verify()


@pytest.mark.parametrize("name", ["flash.json", "resident.safetensors", "ffn.bin", "config.json"])
def test_missing_file(flash, name):
    (flash / name).unlink()
    with pytest.raises(FlashFormatError, match=f"{name}: missing file"):
        FlashDir(flash)


def test_unknown_version(flash):
    m = json.loads((flash / "flash.json").read_text())
    m["format_version"] = 99
    (flash / "flash.json").write_text(json.dumps(m))
    with pytest.raises(FlashFormatError, match="format version 99 is not supported"):
        FlashDir(flash)


def test_malformed_manifest(flash):
    (flash / "flash.json").write_text("{not json")
    with pytest.raises(FlashFormatError, match="not valid JSON"):
        FlashDir(flash)
    (flash / "flash.json").write_text(json.dumps({"format": "mlx_flash", "format_version": 1}))
    with pytest.raises(FlashFormatError, match="malformed manifest"):
        FlashDir(flash)


def test_unsupported_architecture(tiny_dirs, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_dirs["llama"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="'mamba' is not supported"):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_bad_sources(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        convert(str(tmp_path / "nope"), tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        convert(str(tmp_path / "empty"), tmp_path / "out", progress=False)
    (tmp_path / "x.bin").write_bytes(b"not a model")
    with pytest.raises(SourceError, match="not a GGUF file"):
        convert(str(tmp_path / "x.bin"), tmp_path / "out", progress=False)


def test_existing_output_is_not_overwritten(flash, tiny_dirs):
    with pytest.raises(FlashError, match="already exists"):
        convert(str(tiny_dirs["llama"]), flash, progress=False)
    FlashDir(flash)


def test_interrupted_conversion_leaves_nothing_that_loads(tiny_dirs, tmp_path, monkeypatch):
    calls = []

    def boom(self, arrays):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, arrays)

    real = FlashWriter.add_layer
    monkeypatch.setattr(FlashWriter, "add_layer", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_dirs["llama"]), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == []  # the temporary directory is gone too


def test_killed_conversion_leaves_nothing_that_loads(tiny_dirs, tmp_path):
    """SIGKILL mid-way: only a hidden temporary directory can remain, never the output."""
    code = (
        "import sys, os, signal\n"
        "from mlx_flash.format.directory import FlashWriter\n"
        "real = FlashWriter.add_layer\n"
        "def add(self, a):\n"
        "    real(self, a); os.kill(os.getpid(), signal.SIGKILL)\n"
        "FlashWriter.add_layer = add\n"
        "from mlx_flash.convert import convert\n"
        f"convert({str(tiny_dirs['llama'])!r}, {str(tmp_path / 'out')!r}, progress=False)\n"
    )
    r = subprocess.run([sys.executable, "-c", code])
    assert r.returncode == -9
    assert not (tmp_path / "out").exists()
    for leftover in tmp_path.iterdir():
        assert leftover.name.startswith(".out.")
        with pytest.raises(FlashFormatError):
            FlashDir(leftover / "flash")


def test_a_malformed_manifest_error_keeps_its_cause(tiny_dirs, tmp_path):
    """The typed error says what is wrong, and its cause (the JSON or key error) is kept for whoever debugs it."""
    import shutil

    from mlx_flash.errors import FlashFormatError

    path = convert(str(tiny_dirs["llama"]), tmp_path / "f", progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / "flash.json").write_text("{not json")
    with pytest.raises(FlashFormatError, match="not valid JSON") as e:
        FlashDir(bad)
    assert isinstance(e.value.__cause__, json.JSONDecodeError)
    m = json.loads((path / "flash.json").read_text())
    del m["layouts"]
    (bad / "flash.json").write_text(json.dumps(m))
    with pytest.raises(FlashFormatError, match="malformed manifest") as e:
        FlashDir(bad)
    assert isinstance(e.value.__cause__, KeyError)


# ---------------------------------------------------------------------------------------------
# Bounded memory: every source read a tensor at a time, written as it goes
# ---------------------------------------------------------------------------------------------


def test_spooled_safetensors_are_mx_save_safetensors_bytes(tmp_path):
    """A TensorSpool writes exactly the bytes mx.save_safetensors writes for the same dict (header, data order,
    dtypes, non-contiguous and bfloat16 arrays, with and without metadata), and the file's sha256."""
    import hashlib

    from mlx_flash.format.safetensors_io import TensorSpool

    rng = np.random.default_rng(0)
    dtypes = [mx.float16, mx.bfloat16, mx.float32, mx.uint32, mx.uint8, mx.bool_, mx.int32]
    arrays = {}
    for i in range(120):
        shape = tuple(int(x) for x in rng.integers(1, 6, size=i % 4))
        name = f"model.layers.{rng.integers(40)}.m{i}.{('weight', 'scales', 'biases')[i % 3]}"
        arrays[name] = (mx.random.normal(shape) * 8).astype(dtypes[i % len(dtypes)])
    arrays["t"] = mx.arange(12).reshape(3, 4).T.astype(mx.float16)  # a transposed view
    for metadata in ({"format": "mlx"}, None):
        ref = tmp_path / "ref.safetensors"
        mx.save_safetensors(str(ref), arrays, metadata=metadata)
        spool = TensorSpool(tmp_path / "scratch")
        for k, v in arrays.items():
            spool.add(k, v)
        assert np.array_equal(np.array(spool.array("t")), np.array(arrays["t"]))
        sha = spool.save(tmp_path / "new.safetensors", metadata=metadata, checksum=True)
        assert (tmp_path / "new.safetensors").read_bytes() == ref.read_bytes()
        assert sha == hashlib.sha256(ref.read_bytes()).hexdigest()
        assert not (tmp_path / "scratch").exists()


def test_resident_weights_written_one_at_a_time(tmp_path):
    """FlashWriter.finish evaluates and writes the resident arrays one by one: MLX's peak memory stays about one
    array (mx.save_safetensors of the dict held them all), and the file holds what it would have written, its data
    once on disk (no scratch copy: the file is as large as its header and data)."""
    n, shape = 24, (512, 1024)  # 24 lazy float32 arrays of 2 MiB
    resident = {f"model.layers.{i}.w.weight": mx.random.normal(shape, key=mx.random.key(i)) for i in range(n)}
    ref = tmp_path / "ref.safetensors"
    mx.save_safetensors(
        str(ref),
        {k: mx.random.normal(shape, key=mx.random.key(i)) for i, k in enumerate(resident)},
        metadata={"format": "mlx"},
    )
    writer = FlashWriter(tmp_path / "flash")
    one = 512 * 1024 * 4
    mx.reset_peak_memory()
    base = mx.get_active_memory()  # (arrays other tests' fixtures hold)
    writer.finish({"model_type": "llama"}, resident, {})
    assert resident == {}  # each array dropped once written
    assert mx.get_peak_memory() - base < 4 * one, (mx.get_peak_memory() - base) / one
    path = tmp_path / "flash" / "resident.safetensors"
    got, want = mx.load(str(path)), mx.load(str(ref))
    assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]).item() for k in want)
    assert path.stat().st_size == ref.stat().st_size  # (the same header and data, the data in the order written)
    manifest = json.loads((tmp_path / "flash" / "flash.json").read_text())
    import hashlib

    assert manifest["resident"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(os.listdir(tmp_path / "flash")) == [
        "config.json",
        "ffn.bin",
        "flash.json",
        "resident.safetensors",
        "units.crc32",
    ]


def test_a_spool_finished_in_place_leaves_tensors_out(tmp_path):
    """TensorSpool.finish: the scratch file becomes the safetensors file, the tensors left out removed (those after
    moved back), the header padded into the room reserved for all of them; every reader reads the rest."""
    from mlx_flash.format.safetensors_io import TensorSpool, read_header

    arrays = {f"t{i}": mx.arange(i * 100, dtype=mx.float16 if i % 2 else mx.uint32) for i in range(1, 7)}
    spool = TensorSpool(tmp_path / "scratch", reserve=arrays, metadata={"format": "mlx"})
    for k, v in arrays.items():
        spool.add(k, v)
    keep = ["t1", "t3", "t4", "t6"]
    sha = spool.finish(tmp_path / "out.safetensors", keep)
    path = tmp_path / "out.safetensors"
    got = mx.load(str(path))
    assert sorted(got) == keep and all(mx.array_equal(got[k], arrays[k]).item() for k in keep)
    assert set(read_header(path)) == {*keep, "__metadata__"}
    assert path.stat().st_size == spool.start + sum(arrays[k].nbytes for k in keep)
    assert not (tmp_path / "scratch").exists() and sha == hashlib.sha256(path.read_bytes()).hexdigest()


def test_gguf_read_through_its_memory_map(tmp_path, monkeypatch):
    """Above MX_LOAD_MAX_BYTES a GGUF is never loaded whole (mx.load): its tensors are read from the memory map one at
    a time, and the flash directory is byte for byte the one the whole-file path makes."""
    from mlx_flash.convert import gguf as gguf_mod
    from mlx_flash.tools.synthetic_gguf import write_gguf

    src = write_gguf("tiny", tmp_path / "tiny.gguf", progress=False, vocab_size=512)
    whole = convert(str(src), tmp_path / "whole", progress=False)
    real_load, dropped = mx.load, []

    def load(path, *args, **kwargs):
        assert not str(path).endswith(".gguf"), "a GGUF loaded whole"
        return real_load(path, *args, **kwargs)

    real_drop = gguf_mod._drop_pages
    monkeypatch.setattr(gguf_mod, "MX_LOAD_MAX_BYTES", 0)
    monkeypatch.setattr(mx, "load", load)
    monkeypatch.setattr(gguf_mod, "_drop_pages", lambda *a: (dropped.append(a[1:]), real_drop(*a)))
    mapped = convert(str(src), tmp_path / "mapped", progress=False)
    assert len(dropped) == gguf_mod._tensor_count(src)  # every tensor's pages unmapped once read
    for f in sorted(os.listdir(whole)):
        assert (whole / f).read_bytes() == (mapped / f).read_bytes(), f


@pytest.fixture(scope="module")
def llama_ggufs(tmp_path_factory):
    """Two llama GGUFs with the same layers (12 MiB each), 2 and 12 of them: 26 and 133 MiB."""
    from mlx_flash.tools.synthetic_gguf import write_gguf

    root = tmp_path_factory.mktemp("ggufs")
    shape = dict(
        hidden_size=1024,
        intermediate_size=5120,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=4096,
    )
    return [write_gguf("tiny", root / f"l{n}.gguf", progress=False, num_hidden_layers=n, **shape) for n in (2, 12)]


def _peak_anon(cmd):
    """Run `cmd`: (completed process, peak anonymous resident memory in bytes, sampled every 5 ms)."""
    import threading
    import time

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), p.communicate())), daemon=True).start()
    peak = 0
    while p.poll() is None:
        try:
            status = open(f"/proc/{p.pid}/status").read()
            peak = max(peak, int(status.split("RssAnon:")[1].split()[0]) * 1024)
        except (OSError, IndexError):
            pass
        time.sleep(0.005)
    time.sleep(0.1)
    return subprocess.CompletedProcess(cmd, p.returncode, out.get("stdout", ""), out.get("stderr", "")), peak


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_cli_converts_in_bounded_memory_with_progress(llama_ggufs, tmp_path):
    """`python -m mlx_flash.convert`'s peak memory does not grow with the model: 10 more layers (107 MiB more file)
    add less than a quarter of their size to the peak anonymous RSS (holding the model, or its resident weights, or
    a shard, adds about all of it). Progress shows in bytes, from the header on."""
    runs = []
    for src in llama_ggufs:
        r, peak = _peak_anon(
            [sys.executable, "-m", "mlx_flash.convert", "--model", str(src), "--out", str(tmp_path / src.stem)]
        )
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append((src.stat().st_size, peak, r.stderr))
    (small, small_peak, _), (big, big_peak, shown) = runs
    assert big_peak - small_peak < (big - small) / 4, ((big_peak - small_peak) / 2**20, (big - small) / 2**20)
    for s in ("reading the header", "read l12.gguf", "FFN layers", "resident weights", "sha256", "layer 12/12", "B/s"):
        assert s in shown, s
    FlashDir(tmp_path / "l12").verify()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_written_layers_are_freed(kind, tmp_path, monkeypatch):
    """By the time the resident weights are written, no FFN layer or expert is left in MLX memory: each was freed
    once on flash (the MLX memory in use then is a small part of ffn.bin)."""
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    if kind == "moe":
        shape = {**tiny_moe("qwen3_moe"), "num_experts": 32, "moe_intermediate_size": 256, "num_hidden_layers": 4}
        src = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, **shape)
    else:
        src = write_gguf(
            "tiny",
            tmp_path / "d.gguf",
            progress=False,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=4,
            vocab_size=512,
        )
    active, real = [], FlashWriter.finish

    def finish(self, *args, **kwargs):
        active.append(mx.get_active_memory())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FlashWriter, "finish", finish)
    gc.collect()
    before = mx.get_active_memory()  # (arrays other tests keep)
    out = convert(str(src), tmp_path / "out", progress=False, copy=True)  # (experts written, not read in place)
    assert active[0] - before < (out / "ffn.bin").stat().st_size / 4, (
        active[0] - before,
        (out / "ffn.bin").stat().st_size,
    )
