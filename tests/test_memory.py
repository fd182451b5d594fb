"""The budget is the whole process: peak RSS above the baseline `load` records stays under it, the
selector's DRAM is planned, and the stats say so."""

import mlx_flash
from mlx_flash.budget import parse_size
from mlx_flash.default_model import default_model_dir
from mlx_flash.errors import BudgetError
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory

import pytest

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


@pytest.mark.skipif(memory._MALLOC_TRIM is None, reason="glibc's malloc_trim")
def test_give_back_returns_what_the_allocator_kept():
    """Blocks below the mmap threshold freed between live ones stay in glibc's heap (its top is all it trims by
    itself); `give_back` (between a prompt's passes) returns their pages."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from mlx_flash.io import memory\n"
        "memory.mmap_large_blocks()\n"
        "blocks = [np.ones(64 << 10, np.uint8) for _ in range(640)]\n"  # (40 MiB in 64 KiB blocks)
        "del blocks[::2]\n"
        "before = memory.rss()\n"
        "memory.give_back()\n"
        "print(before - memory.rss())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 16 << 20  # (of the 20 MiB freed)


def test_macos_footprint_struct_is_rusage_info_v4():
    """The ctypes layout macOS's proc_pid_rusage fills (<sys/resource.h>): a 16-byte UUID, then 35 64-bit counters;
    the footprint is the 8th, its peak since the last reset the 34th."""
    import ctypes

    info = memory.RusageInfoV4
    assert ctypes.sizeof(info) == 16 + 35 * 8
    assert info.phys_footprint.offset == 16 + 7 * 8 and info.interval_max_phys_footprint.offset == 16 + 33 * 8
    assert memory.measured()  # (Linux: /proc)


def _generate(generate_capped, budget: str):
    return generate_capped(
        default_model_dir(), budget, "--prompt", PROMPT, "--max-tokens", "8", "--ignore-chat-template"
    )


@pytest.mark.parametrize("budget", ["25%", "50%", "80%"])
def test_generate_holds_its_budget_under_a_hard_cap(budget, generate_capped):
    """Under a cgroup limit of budget + baseline, generate completes (no OOM kill), and its own peak RSS
    above the baseline it recorded is inside the budget."""
    r, peak = _generate(generate_capped, budget)
    assert r.ok, r.summary() + "\n" + r.stderr
    assert peak, r.stdout
    assert 0 < peak <= parse_size(budget, FlashDir(default_model_dir()).model_bytes), r.stdout


def test_a_budget_that_cannot_hold_is_refused_before_loading(generate_capped):
    r, _ = _generate(generate_capped, "10%")
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
