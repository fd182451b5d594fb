"""Where a streamed token's compute goes: one decode run of a flash directory, timing the native attention
block (which reads no streamed byte) beside `generate --stats`' medians (issue #24).

    python benchmarks/streamed_compute_probe.py --model DIR --mode resident|overlapped|serial [--reader-threads N]
        [--background-reads] [--max-tokens 12]

Modes: resident (no budget), overlapped (the budget, reads overlapped with compute: the default), serial (each
chunk read, then computed; no read-ahead). --background-reads runs 16 threads of 1 MiB O_DIRECT reads of ffn.bin
beside the run (resident: the reads' cost to compute without streaming). If attention slows as much as the FFN,
the cost is the reads running beside compute, not the streamed rows. The page cache of the directory is dropped
first. Set OMP_NUM_THREADS / GOMP_SPINCOUNT in the environment to compare thread counts and spin policies.
"""

import argparse
import json
import mmap
import os
import threading
import time

import mlx_flash  # noqa: F401  (first: OpenBLAS before mlx.core)
from mlx_flash.compute import cpu_gemv
from mlx_flash.generate import generate_step
from mlx_flash.loader import load
from mlx_flash.tools.cap import drop_page_cache

import mlx.core as mx
import numpy as np


class _TimedNative:
    """cpu_gemv's extension with its attention block timed."""

    def __init__(self, native):
        self.native, self.times = native, []

    def __getattr__(self, name):
        return getattr(self.native, name)

    def attention(self, *args):
        t = time.perf_counter()
        out = self.native.attention(*args)
        self.times.append(time.perf_counter() - t)
        return out


def _background_reads(path: str, threads: int = 16) -> list:
    """Threads reading `path` 1 MiB at a time with O_DIRECT, forever (daemons); returns [MiB read]."""
    fd, done = os.open(path, os.O_RDONLY | os.O_DIRECT), [0]
    size = os.fstat(fd).st_size

    def run(i):
        buf, off = mmap.mmap(-1, 1 << 20), i << 20
        while True:
            os.preadv(fd, [buf], off)
            off, done[0] = (off + (threads << 20)) % (size - (2 << 20)), done[0] + 1

    for i in range(threads):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    return done


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Attention and FFN compute of a decode run, resident or streamed.")
    p.add_argument("--model", required=True, help="Flash directory.")
    p.add_argument("--mode", default="overlapped", choices=("resident", "overlapped", "serial"))
    p.add_argument("--memory-budget", default="2300MiB", help="Budget of the streamed modes.")
    p.add_argument("--reader-threads", type=int, default=None, help="The FFN reader's threads (default: load's).")
    p.add_argument("--background-reads", action="store_true", help="16 threads reading ffn.bin beside the run.")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=12)
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    drop_page_cache([args.model])
    model, tok = load(
        args.model,
        memory_budget=None if args.mode == "resident" else args.memory_budget,
        sparsity="dense",
        context=256,
        threads=args.reader_threads,
    )
    engine = model.flash
    if args.mode == "serial":
        engine.overlap, engine.read_ahead = False, None
    timed = cpu_gemv._native = _TimedNative(cpu_gemv._native)
    try:
        read = _background_reads(os.path.join(args.model, "ffn.bin")) if args.background_reads else None
        t0 = time.perf_counter()
        steps = generate_step(mx.array(tok.encode(args.prompt)), model, max_tokens=args.max_tokens)
        next(steps), next(steps)  # the prompt and the first token: not timed
        timed.times.clear()
        for _ in steps:
            pass
        seconds = time.perf_counter() - t0
    finally:
        cpu_gemv._native = timed.native
    t = np.array(timed.times) * 1e3
    out = {
        "mode": args.mode,
        "attention_ms_per_layer": float(np.median(t)),
        "attention_ms_per_token": float(t.sum() / max(1, args.max_tokens - 2)),
        **{k: v for k, v in engine.stats.summary().items() if k.endswith("_ms")},
    }
    if read is not None:
        out["background_read_gib_s"] = read[0] / 1024 / seconds
    print(json.dumps(out))


if __name__ == "__main__":
    main()
