"""The generate command end to end on a tiny model: text, per-token stats, clear budget errors."""

import subprocess
import sys

from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.models.tiny import make_tiny_model_dir

import pytest


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    return convert(str(make_tiny_model_dir("llama", root / "src")), root / "flash", progress=False)


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_flash.generate", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_with_stats(flash):
    r = run(
        "--model", str(flash), "--prompt", "hello", "--max-tokens", "6", "--memory-budget", "250%", "--stats"
    )  # tiny: scratch dominates
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "per-token stats" in out and out.count("[token") == 5  # 6 tokens: the first from the prompt's pass
    assert "summary over" in out and "hit rate" in out and "/token" in out
    assert "unit caches" in out  # the budget plan
    assert "CPU: quantised decode matvecs" in out and "BLAS" in out  # which CPU paths ran (Linux: always CPU)


def test_generate_budget_too_small(flash):
    r = run("--model", str(flash), "--prompt", "hello", "--max-tokens", "4", "--memory-budget", "1%")
    assert r.returncode == 1
    assert "error: memory budget" in r.stderr and "Traceback" not in r.stderr


def test_generate_not_a_flash_dir(tmp_path):
    r = run("--model", str(tmp_path), "--prompt", "hello")
    assert r.returncode == 1 and "flash.json: missing file" in r.stderr


def test_auto_alignment(flash, tmp_path):
    fd = FlashDir(flash)
    assert fd.alignment == 512 and fd.layouts["neurons"].nbytes < 4096  # small units: not padded to 4 KiB
    src = make_tiny_model_dir("llama", tmp_path / "src", hidden_size=512)
    big = FlashDir(convert(str(src), tmp_path / "big", progress=False))
    assert big.layouts["neurons"].nbytes >= 4096 and big.alignment == 4096
    forced = FlashDir(convert(str(src), tmp_path / "forced", alignment=1024, progress=False))
    assert forced.alignment == 1024 and all(r.offset % 1024 == 0 for r in forced.regions())
