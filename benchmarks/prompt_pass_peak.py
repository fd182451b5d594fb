"""A resident model's first prompt (its units read) and second (its units cached): each pass's time and its peak RSS
above the memory before it, for each checkout given (e.g. before and after a change), alternated over rounds.

    python benchmarks/prompt_pass_peak.py --model FLASH_DIR --length 256 --checkouts OLD,NEW --rounds 2 \
        --json benchmarks/results/prompt_pass_peak_llama7b.json

Each run is this script with --child in a process of its own that imports the checkout's package and kernels
(`python setup.py build_ext --inplace` there first): it loads the model without a budget and times two prompts of
`length` tokens, each in one pass.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(model: str, n: int) -> dict:
    import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.generate import generate_step
    from mlx_flash.io import memory
    from mlx_flash.loader import load, load_tokenizer
    from mlx_flash.texts import read_text

    import mlx.core as mx

    ids = load_tokenizer(FlashDir(model)).encode(read_text(half="second"))
    loaded, _ = load(model, memory_budget=None, context=2 * n + 16)
    out = {}
    for name, prompt in (("first", ids[:n]), ("second", ids[n : 2 * n])):  # (the first reads every unit, cached)
        before = memory.rss()
        memory.reset_peak()
        start = time.perf_counter()
        next(generate_step(mx.array(prompt), loaded, max_tokens=1, prefill_step_size=n))
        out[f"{name}_s"] = time.perf_counter() - start
        out[f"{name}_peak_mib"] = (memory.peak_rss() - before) / 2**20
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--checkouts", default=".", help="Comma-separated checkout directories.")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.length)))
        return
    from mlx_flash.tools.bench_io import machine_info
    from mlx_flash.tools.peers_systems import versions

    checkouts = [str(Path(c).resolve()) for c in args.checkouts.split(",")]
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(args.model), "versions": versions()}
    out.update(model=args.model, length=args.length, runs=[], summary={})
    for r in range(args.rounds):
        for c in checkouts if r % 2 == 0 else checkouts[::-1]:
            env = {**os.environ, "PYTHONPATH": c}
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--length", str(args.length)]
            res = subprocess.run(cmd, env=env, cwd=c, capture_output=True, text=True, check=True)
            out["runs"].append({"round": r, "checkout": c, **json.loads(res.stdout.splitlines()[-1])})
            print(json.dumps(out["runs"][-1]), flush=True)
    for c in checkouts:
        runs = [x for x in out["runs"] if x["checkout"] == c]
        keys = [k for k in runs[0] if k not in ("round", "checkout")]
        out["summary"][c] = {k: statistics.median(x[k] for x in runs) for k in keys}
    print(json.dumps(out["summary"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
