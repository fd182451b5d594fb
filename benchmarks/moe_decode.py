"""Decode speed of an MoE flash directory under memory budgets, with its routing checked.

    python benchmarks/moe_decode.py --model DIR --budgets 25%,50%,none --tokens 32 [--json out.json]

Random-weight models repeat one token when they generate, so every step would route alike and every
expert read would hit. Here each step's input is instead a random token id (teacher-forced, the same
sequence for every budget: labelled "forced random tokens"), which gives routing as varied as random
weights allow (no reuse beyond chance). Per budget, in a fresh process with the directory's page cache
dropped: tokens/s over the decode steps (after a 1-token prompt), hit rate of the expert caches, device
bytes per token, and experts used per layer over the run (the routing check of issue #23).
"""

import argparse
import json
import statistics
import subprocess
import sys

from tqdm import tqdm

from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import drop_page_cache

_CHILD = """
import json, statistics, sys, time
import numpy as np
import mlx_flash  # noqa: F401
import mlx.core as mx
from mlx_flash.loader import load
model_dir, budget, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, _ = load(model_dir, memory_budget=None if budget == "none" else budget, context=n + 16)
e = model.flash
vocab = e.fd.config["vocab_size"]
ids = np.random.default_rng(0).integers(0, vocab, n + 1)
cache = model.make_cache()
times = []
for i, t in enumerate(ids):
    tic = time.perf_counter()
    mx.eval(model(mx.array([[int(t)]]), cache=cache))
    times.append(time.perf_counter() - tic)
e.stats.end()
toks = e.stats.tokens[1:]
hits, misses = sum(t.hits for t in toks), sum(t.misses for t in toks)
per_layer = [int((c.use_count > 0).sum()) for c in e.caches if c is not None]  # every activation counts
print(json.dumps({"tok_s": (len(times) - 1) / sum(times[1:]),
                  "hit_rate": hits / max(1, hits + misses), "bytes_per_token": statistics.median(t.bytes_read for t in toks),
                  "io_ms": 1e3 * statistics.median(t.io_s for t in toks), "experts_used_per_layer": per_layer,
                  "slots": e.plan.capacity[0].get("experts"), "peak_rss": e.stats.peak_rss()}))
"""


def setup_arg_parser():
    p = argparse.ArgumentParser(description="MoE decode under memory budgets (forced random tokens).")
    p.add_argument("--model", required=True, help="MoE flash directory.")
    p.add_argument("--budgets", default="50%,none", help="Comma-separated budgets (none: every expert cached).")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None)
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    budgets = args.budgets.split(",")
    runs = []
    for r, b in tqdm([(r, b) for r in range(args.rounds) for b in budgets], desc="moe decode", unit="run"):
        drop_page_cache([args.model])
        out = subprocess.run([sys.executable, "-c", _CHILD, args.model, b, str(args.tokens)], capture_output=True,
                             text=True)
        if out.returncode:
            raise SystemExit(f"budget {b}: {out.stderr[-2000:]}")
        runs.append({"round": r, "budget": b, **json.loads(out.stdout.strip().splitlines()[-1])})
    print(f"{args.model}: {args.tokens} forced random tokens (decode steps), medians over {args.rounds} round(s)")
    print("| budget | expert slots/layer | tok/s | hit rate | read/token | I/O wait/token | experts used per layer (min-max) |")
    print("|---|---|---|---|---|---|---|")
    for b in budgets:
        rs = [x for x in runs if x["budget"] == b]
        used = rs[0]["experts_used_per_layer"]
        print(f"| {b} | {rs[0]['slots']} | {statistics.median(x['tok_s'] for x in rs):.2f} | "
              f"{statistics.median(x['hit_rate'] for x in rs):.1%} | "
              f"{statistics.median(x['bytes_per_token'] for x in rs) / 2**20:.1f} MiB | "
              f"{statistics.median(x['io_ms'] for x in rs):.0f} ms | {min(used)}-{max(used)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "runs": runs, "machine": machine_info(args.model)},
                      f, indent=1)


if __name__ == "__main__":
    main()
