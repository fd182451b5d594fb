"""I/O overlapped with compute, on and off, in one run: the runtime's hits are computed while its
misses are read (NeuronEngine.overlap), against waiting for the misses first.

    python benchmarks/bench_overlap.py [--synthetic llama-7b] [--memory-budget 80%] [--tokens 24] [--rounds 2]

Both configurations are bench's "all" (sparsifier + window cache + bundles) under the same budget,
each from a fresh engine with cold caches, alternated for --rounds rounds (a shared machine's load
changes spread over both); per-token medians over all rounds. I/O ms is the time the decode step
waited for reads, so it shrinks when reads hide behind compute; total ms is what the overlap buys.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_flash  # noqa: E402,F401  (OpenBLAS before mlx.core)
from mlx_flash import bench  # noqa: E402
from mlx_flash.budget import parse_size  # noqa: E402
from mlx_flash.calib.trace import default_trace  # noqa: E402
from mlx_flash.default_model import default_model_dir  # noqa: E402
from mlx_flash.format.directory import FlashDir  # noqa: E402
from mlx_flash.loader import load  # noqa: E402
from mlx_flash.tools.bench_io import machine_info  # noqa: E402

import numpy as np  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--synthetic", default=None)
    p.add_argument("--memory-budget", default="80%")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    if a.synthetic:
        from mlx_flash.tools.synthetic import build

        path, trace = build(a.synthetic), default_trace(a.density)
    else:
        path, trace = a.model or default_model_dir(), None
    fd = FlashDir(path)
    context = a.prompt_tokens + a.tokens + 8
    budget = parse_size(a.memory_budget, fd.model_bytes)
    model, _ = load(path, memory_budget=budget, sparsity="dense", context=context)
    prompt = np.random.default_rng(0).integers(0, fd.config["vocab_size"], a.prompt_tokens).tolist()
    runs = {True: [], False: []}
    for r in range(a.rounds):
        for overlap in (True, False):
            sparsifier, desc = bench.choose_sparsifier(fd, a.density, trace)
            engine = bench.make_engine(model, fd, model.flash.reader, sparsifier, budget, context)
            engine.overlap = overlap
            t = time.perf_counter()
            times = bench.decode(model, prompt, a.tokens)
            engine.stats.end()
            toks = engine.stats.decode_tokens()[-len(times) :]
            runs[overlap] += [(t_.io_s, t_.total_s, t_.bytes_read) for t_ in toks]
            print(f"round {r} overlap={overlap}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    model.flash.close()

    out = {
        "model": str(path),
        "memory_budget": a.memory_budget,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "sparsifier": desc,
        "machine": machine_info(str(path)),
        "configs": {},
    }
    print(f"{Path(path).name}, budget {a.memory_budget}, {a.tokens} tokens x {a.rounds} rounds, {desc}")
    print("| config | I/O ms (waited) | total ms (p10-p90) | MiB read / token |\n|---|---|---|---|")
    for overlap, rows in runs.items():
        io, total, nbytes = (np.array(c) for c in zip(*rows))
        r = {
            "io_ms": float(np.median(io) * 1e3),
            "total_ms": float(np.median(total) * 1e3),
            "total_ms_p10": float(np.percentile(total, 10) * 1e3),
            "total_ms_p90": float(np.percentile(total, 90) * 1e3),
            "bytes_per_token": float(nbytes.mean()),
        }
        name = "overlapped" if overlap else "read, then compute"
        out["configs"][name] = r
        print(
            f"| {name} | {r['io_ms']:.1f} | {r['total_ms']:.1f} ({r['total_ms_p10']:.1f}-{r['total_ms_p90']:.1f}) | "
            f"{r['bytes_per_token'] / 2**20:.2f} |"
        )
    c = out["configs"]
    out["total_ratio"] = c["read, then compute"]["total_ms"] / c["overlapped"]["total_ms"]
    print(f"total (read, then compute) / total (overlapped) = {out['total_ratio']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
