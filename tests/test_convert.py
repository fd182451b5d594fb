"""Converter and flash format v1: bit-exact bundles, resident-only logits, clear errors."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import FlashError, FlashFormatError, SourceError, UnsupportedArchitectureError
from mlx_flash.architectures import ADAPTERS
from mlx_flash.convert import convert
from mlx_flash.flash_format import FlashDir, FlashWriter
from mlx_flash.loader import load_resident
from mlx_flash.models.tiny import make_tiny_model_dir
from mlx_flash.convert.source import load_source_model

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


@pytest.mark.parametrize("layout,expected", [("neurons", {"bits": 4, "group_size": 32, "resident_scales": True}),
                                             ("dip", {"bits": 8, "group_size": 32})])
def test_default_down_rows(tiny_dirs, tmp_path, layout, expected):
    """By default down keeps the model's own 4-bit codes (neurons layout); where that cannot be (dip), 8 bits."""
    fd = FlashDir(convert(str(tiny_dirs["llama"]), tmp_path / "q", bits=4, group_size=32, layout=layout, progress=False))
    assert fd.ffn["matrices"]["down"]["quantization"] == expected


@pytest.mark.parametrize("arch", ["llama", "phi3", "opt"])
def test_quantised_bundles(arch, tiny_dirs, tmp_path):
    """--bits 4 --down-bits 8 on a float source: every row matrix and the transposed down/fc2 quantised once, per neuron."""
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
    fd = FlashDir(convert(str(tiny_dirs["llama"]), tmp_path / "dip", layout="dip", bits=bits, group_size=32, progress=False))
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
        "from mlx_flash.flash_format import FlashWriter\n"
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
