"""A prompt's compute against its chunk size, the model resident (no reads): time to the first token of one prompt
in passes of each given size, alternating over rounds, in one process (the model loaded once). `--gguf FILE`: then
llama.cpp's resident prompt speed on the same weights (llama-bench -p LENGTH -n 0 after its warm-up run, 2 threads).

    python benchmarks/chunk_compute.py --model DIR --length 256 --steps 24,96 --rounds 2 \
        --json benchmarks/results/chunk_compute_llama7b.json
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import load, load_tokenizer
from mlx_flash.texts import read_text
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.peers_systems import llama_bench_cmd, versions

import mlx.core as mx


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", default="24,96")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", default=None)
    p.add_argument("--gguf", default=None, help="llama.cpp's resident prompt speed on this GGUF too.")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    prompt = load_tokenizer(FlashDir(args.model)).encode(read_text(half="second"))[: args.length]
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(args.model), "versions": versions()}
    if args.gguf:  # (first: its repacked copy of the weights and ours would not fit in memory together)
        cmd = llama_bench_cmd(args.gguf, prompt=len(prompt), rounds=args.rounds)
        test = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)[-1]
        out["llama_cpp"] = {"command": " ".join(cmd), "ttft_s": test["avg_ns"] / 1e9, "tok_s": test["avg_ts"]}
        print(json.dumps(out["llama_cpp"]), flush=True)
    model, _ = load(args.model, memory_budget=None, backend=args.backend, context=len(prompt) + 16)
    out.update(model=args.model, length=len(prompt), forward=model.forward.name, runs=[], summary={})
    steps = [int(s) for s in args.steps.split(",")]
    for r in range(args.rounds):
        for step in steps if r % 2 == 0 else steps[::-1]:
            start = time.perf_counter()
            next(generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=step))
            out["runs"].append({"round": r, "step": step, "ttft_s": time.perf_counter() - start})
            print(json.dumps(out["runs"][-1]), flush=True)
    for step in steps:
        out["summary"][step] = statistics.median(x["ttft_s"] for x in out["runs"] if x["step"] == step)
    model.flash.close()
    print(json.dumps(out["summary"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
