"""Bytes read at the device: the runtime's count (its readers' bytes_read, per token) against the kernel's own
count for the process (/proc/self/io read_bytes) over a real run of the default model."""

import os
from pathlib import Path

import mlx_flash
from mlx_flash.default_model import default_model_dir

import pytest

PROC_IO = Path("/proc/self/io")


def kernel_read_bytes() -> int:
    return int(next(line for line in PROC_IO.read_text().splitlines() if line.startswith("read_bytes:")).split()[1])


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not PROC_IO.is_file(), reason="no /proc/self/io on this system")
@pytest.mark.parametrize("budget", ["35%", "60%"])  # with and without resident weights streamed
def test_device_bytes_match_the_kernels_count(budget):
    path = default_model_dir()
    model, tok = mlx_flash.load(path, memory_budget=budget, sparsity="dense", context=64)
    try:
        for f in ("ffn.bin", "resident.safetensors"):
            drop_page_cache(path / f)
        stats = model.flash.stats
        kernel0, pool0 = kernel_read_bytes(), stats.device_bytes()
        mlx_flash.generate(model, tok, "The history of the city begins", max_tokens=6)
        kernel, pool = kernel_read_bytes() - kernel0, stats.device_bytes() - pool0
        assert pool > 20 << 20  # dense at this budget reads most of the FFN every token
        assert kernel == pytest.approx(pool, rel=0.03)
        # every byte lands in some token, but reads started for a token that never came (the next
        # layer read ahead, the next streamed layer) may finish after the last one closed
        in_tokens = sum(t.bytes_read for t in stats.tokens)
        assert in_tokens <= pool and in_tokens == pytest.approx(pool, rel=0.02)
        # gap fills and alignment come on top of what was asked (all of it: a read asked in the last token may
        # land after it closed, in no token)
        assert pool >= sum(t.bytes_requested for t in stats.tokens)
    finally:
        model.flash.close()
