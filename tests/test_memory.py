"""The budget is the whole process: peak RSS above the baseline `load` records stays under it, the
selector's DRAM is planned, and the stats say so."""

import re
import sys

import pytest

import mlx_flash
from mlx_flash import memory
from mlx_flash.budget import parse_size
from mlx_flash.tools.cap import run_capped
from mlx_flash.default_model import default_model_dir
from mlx_flash.errors import BudgetError, CapError
from mlx_flash.flash_format import FlashDir

PROMPT = "The history of the city begins. " * 8  # ~60 tokens: prefill activations count too


def test_memory_readings_move():
    import mmap

    before = memory.rss()
    block = mmap.mmap(-1, 64 << 20)  # fresh pages (malloc could reuse ones this process already holds)
    for i in range(0, len(block), 4096):
        block[i] = 1  # touch every page
    assert memory.rss() - before > 48 << 20 and memory.peak_rss() >= memory.rss()
    block.close()
    assert memory.reset_peak() and memory.peak_rss() < before + (48 << 20)


@pytest.fixture(scope="module")
def baseline() -> int:
    """Peak RSS of the interpreter with mlx and mlx-lm imported and the default model's tokenizer loaded."""
    r = run_capped(memory.baseline_command(default_model_dir()))
    assert r.ok, r.stderr
    return r.max_rss


def generate_capped(budget: str, baseline: int):
    path = default_model_dir()
    limit = parse_size(budget, FlashDir(path).model_bytes) + baseline
    try:
        return run_capped([sys.executable, "-m", "mlx_flash.generate", "--prompt", PROMPT, "--memory-budget", budget,
                           "--max-tokens", "8", "--stats", "--ignore-chat-template"], limit=limit, drop=[path], timeout=600)
    except CapError as e:
        pytest.skip(f"no hard memory cap on this machine: {e}")


@pytest.mark.parametrize("budget", ["25%", "50%", "80%"])
def test_generate_holds_its_budget_under_a_hard_cap(budget, baseline):
    """Under a cgroup limit of budget + baseline, generate completes (no OOM kill), and its own peak RSS
    above the baseline it recorded is inside the budget."""
    r = generate_capped(budget, baseline)
    assert r.ok, r.summary() + "\n" + r.stderr
    m = re.search(r"memory: peak RSS ([\d.]+) MiB above the baseline of ([\d.]+) MiB", r.stdout)
    assert m, r.stdout
    peak = float(m.group(1)) * 2**20
    assert 0 < peak <= parse_size(budget, FlashDir(default_model_dir()).model_bytes), r.stdout


def test_a_budget_that_cannot_hold_is_refused_before_loading(baseline):
    r = generate_capped("10%", baseline)
    assert not r.oom_killed and r.returncode == 1, r.summary()
    assert "error: memory budget" in r.stderr and "Traceback" not in r.stderr


def test_the_oracles_copy_is_in_the_plan():
    """The oracle keeps gate/up in DRAM: a budget that holds dense streaming but not that copy is refused."""
    path = default_model_dir()
    model, _ = mlx_flash.load(path, memory_budget="50%", sparsity="dense", context=256)
    model.flash.close()
    with pytest.raises(BudgetError, match="extra"):
        mlx_flash.load(path, memory_budget="50%", sparsity="oracle", context=256)
    model, tok = mlx_flash.load(path, memory_budget="80%", sparsity="oracle", density=0.5, context=256)
    try:
        oracle = model.flash.sparsifier
        assert model.flash.plan.extra == oracle.nbytes > 30 << 20
        mlx_flash.generate(model, tok, "Hello", max_tokens=3)
        assert 0 < model.flash.stats.summary()["peak_rss_bytes"] <= model.flash.plan.budget
    finally:
        model.flash.close()
