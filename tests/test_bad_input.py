"""Bad input never crashes, corrupt data never speaks: what a careless or hostile user can do to the default
model's directory (a copy of it) and to generate's arguments ends in one line naming what is wrong, never a
traceback, and never in text computed from bytes that are not the model's."""

import json
import os
import re
import shutil
import subprocess
import sys

from mlx_flash.default_model import default_model_dir
from mlx_flash.errors import FlashFormatError
from mlx_flash.format.directory import FFN, MANIFEST, RESIDENT, FlashDir

import pytest


@pytest.fixture(scope="module")
def smol():
    return default_model_dir()


@pytest.fixture
def copy(smol, tmp_path):
    """A fresh copy of the default model's directory."""
    return shutil.copytree(smol, tmp_path / "m")


def run(command, *args, env=None):
    return subprocess.run(
        [sys.executable, "-m", f"mlx_flash.{command}", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **(env or {})),
    )


def generate(model, *args, env=None):
    return run(
        "generate", "--model", model, "--prompt", "The capital of France is", "-m", 8, "--temp", 0, *args, env=env
    )


def assert_refused(r, pattern):
    """A command that ended with one line saying what is wrong: a nonzero exit, no traceback."""
    assert r.returncode not in (0, -11) and r.returncode < 128, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert re.search(pattern, r.stderr), r.stderr


def edit_manifest(path, edit):
    m = json.loads((path / MANIFEST).read_text())
    edit(m)
    (path / MANIFEST).write_text(json.dumps(m))


def overwrite(path, offset, nbytes, byte=0xFF):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([byte]) * nbytes)


# -- corrupt data ---------------------------------------------------------------------------------------------
def test_a_corrupted_resident_block_is_refused_at_load(copy):
    overwrite(copy / RESIDENT, (copy / RESIDENT).stat().st_size // 2 // 4096 * 4096, 4096)
    assert_refused(generate(copy, "--memory-budget", "50%"), r"resident\.safetensors.*checksum")
    assert_refused(run("verify", copy), r"checksum")


@pytest.mark.parametrize("budget", ["50%", None])
def test_a_corrupted_unit_is_refused_when_read(copy, budget):
    """Layer 0's first units overwritten: streamed (50%: read unit by unit) or all cached (read whole)."""
    r = FlashDir(copy).layers[0]["neurons"]
    overwrite(copy / FFN, r.offset, 4096)
    args = ("--memory-budget", budget) if budget else ()
    assert_refused(generate(copy, *args), r"checksum mismatch.*layer 0")
    assert_refused(run("verify", copy), r"checksum mismatch.*layer 0")


def test_verify_finds_a_missing_tokenizer(copy):
    (copy / "tokenizer.json").unlink()
    assert_refused(run("verify", copy), r"tokenizer")


def test_a_manifest_cut_short_is_refused(copy):
    edit_manifest(copy, lambda m: m.update(layers=m["layers"][:5]))
    with pytest.raises(FlashFormatError, match="layers"):
        FlashDir(copy)
    assert_refused(run("verify", copy), r"layers")


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("n_units", 0, "n_units"),
        ("n_units", -3, "n_units"),
        ("offset", -512, "offset"),
        ("stride", 0, "stride"),
        ("n_units", "12", "n_units"),
    ],
)
def test_region_fields_are_checked_at_load(copy, field, value, pattern):
    edit_manifest(copy, lambda m: m["layers"][0]["regions"]["neurons"].update({field: value}))
    with pytest.raises(FlashFormatError, match=pattern):
        FlashDir(copy)
    assert_refused(generate(copy, "--memory-budget", "50%"), pattern)


@pytest.mark.parametrize("name", ["/etc/passwd", "../predictors.safetensors", "sub/../../x"])
def test_files_named_by_the_manifest_stay_inside_the_directory(copy, name):
    edit_manifest(copy, lambda m: m.update(sparsity={"predictor": {"file": name, "threshold": 0.5}}))
    with pytest.raises(FlashFormatError, match="outside"):
        FlashDir(copy)


def test_an_injected_read_error_ends_generate_with_one_line(copy):
    """MLX_FLASH_FAIL_READ=n fails the n-th batch of reads with EIO: the command says so and exits 1."""
    r = generate(copy, "--memory-budget", "50%", env={"MLX_FLASH_FAIL_READ": "40"})
    assert_refused(r, r"error: .*Errno 5.*read failed")


# -- arguments ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", ["inf%", "-5%", "nan%", "0", "-1GB", "1e400", "lots"])
def test_budgets_that_are_not_sizes(smol, budget):
    assert_refused(generate(smol, f"--memory-budget={budget}"), re.escape(repr(budget)) + r".*\(examples: 2GB")


@pytest.mark.parametrize("args, pattern", [(("-m", "0"), "max-tokens"), (("-m", "-7"), "max-tokens")])
def test_max_tokens_that_are_not_counts(smol, args, pattern):
    assert_refused(generate(smol, *args), pattern)


def test_an_empty_raw_prompt(smol):
    r = run("generate", "--model", smol, "--prompt", "", "--ignore-chat-template", "-m", 4)
    assert_refused(r, "empty")


def test_a_model_path_that_does_not_exist(tmp_path):
    assert_refused(generate(tmp_path / "nothing"), r"nothing")


# -- the budget to the last token -------------------------------------------------------------------------------
def test_unlimited_tokens_end_at_the_planned_context(smol, wikitext):
    """-m -1 plans the longest KV cache the budget holds beside its units and stops there, saying so (a prompt of
    running text that fills all of it but 24 tokens: no end of sequence before the context is full)."""
    from mlx_flash import load, stream_generate

    model, tokenizer = load(smol, memory_budget="50%", context=None)
    try:
        context = model.flash.context
        assert 16 < context < 8192
        prompt = tokenizer.encode(wikitext[: 8 * context])[: context - 24]
        out = list(stream_generate(model, tokenizer, prompt, max_tokens=-1))
        assert len(prompt) + len(out) == context
        assert out[-1].finish_reason == "length"
    finally:
        model.flash.close()


def test_unlimited_tokens_under_a_hard_cap(smol, generate_capped, wikitext):
    """A raw prompt of running text, continued without end of sequence until the planned context is full."""
    prompt = wikitext[:1200]
    r, peak = generate_capped(smol, "50%", "-m", "-1", "--temp", "0", "--ignore-chat-template", "--prompt", prompt)
    assert r.ok, r.stderr
    assert "[stopped at the planned context of" in r.stderr, r.stdout[-2000:]


CRC_CHECK = """
import zlib, numpy as np
from mlx_flash.io import checks
buf = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
for length in (0, 1, 7, 1008, 4099):
    offsets = np.arange(3, len(buf) - length, 1531)
    assert checks.crc32_at(buf, offsets, length).tolist() == [zlib.crc32(buf[o : o + length]) for o in offsets]
"""


def test_the_native_crc_without_the_system_zlib():
    """The extension's own CRC table, used where the system's zlib cannot be opened."""
    r = subprocess.run([sys.executable, "-c", CRC_CHECK], env=dict(os.environ, MLX_FLASH_NO_ZLIB="1"))
    assert r.returncode == 0


@pytest.mark.parametrize("native", [True, False])
def test_unit_checksums_are_zlibs_crc32(monkeypatch, native):
    """What convert writes and the engine checks is zlib's CRC-32, native or not, at any offset and length."""
    import zlib

    from mlx_flash.io import checks

    import numpy as np

    if not native:
        monkeypatch.setattr(checks, "_native", None)
    buf = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    for length in (0, 1, 7, 1008, 4099):
        offsets = np.arange(3, len(buf) - length, 1531)
        want = [zlib.crc32(buf[o : o + length]) for o in offsets]
        assert checks.crc32_at(buf, offsets, length).tolist() == want
